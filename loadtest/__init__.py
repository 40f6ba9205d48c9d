"""Locust load tests for pagechat's /v1/chat WebSocket protocol (docs/deploy.md)."""
