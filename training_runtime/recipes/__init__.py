"""Built-in recipes: `entry_point: recipe:<name>` runs `python -m dtrain.runtime.recipes.<name>`."""
