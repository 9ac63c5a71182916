"""Test-only extensions, each one file: a method, an accelerator, a metric (issue 32)."""
