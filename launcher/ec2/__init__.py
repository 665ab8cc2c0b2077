"""The EC2 target (client side): placement group, EFA nodes, S3."""
