"""Every touchpoint of DeepSpeed's and torch's private APIs, each checked against the installed version by a test."""
