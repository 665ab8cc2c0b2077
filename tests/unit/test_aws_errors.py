"""AWS errors reach the user as one line: what failed, AWS's words, the fix — never a raw page."""

from __future__ import annotations

from botocore.exceptions import ClientError
from dtrain.launcher import aws

PAGE = ("<!DOCTYPE html>\n<html><head><title>500 Internal Server Error</title></head>"
        "<body><h1>Internal Server Error</h1><p>The server encountered an internal error."
        "</p></body></html>")


def test_an_html_error_page_becomes_one_readable_line():
    exc = ClientError({"Error": {"Code": "500", "Message": PAGE},
                       "ResponseMetadata": {"HTTPStatusCode": 500}}, "StopTrainingJob")
    message = str(aws.as_dtrain_error(exc, "StopTrainingJob j"))
    assert "<" not in message and "\n" not in message
    assert message.startswith("StopTrainingJob j failed: 500: the service answered with an HTML "
                              "page (HTTP 500): 500 Internal Server Error Internal Server Error")


def test_aws_own_message_is_kept_verbatim_with_the_fix():
    exc = ClientError({"Error": {"Code": "AccessDenied", "Message": "Access   Denied"}},
                      "PutObject")
    assert str(aws.as_dtrain_error(exc, "uploading the code")) == (
        "uploading the code failed: AccessDenied: Access Denied; check the IAM permissions of "
        "your AWS credentials")
