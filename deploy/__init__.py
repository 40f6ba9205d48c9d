"""Deployment files: the nginx config in front of the replicas is rendered by nginx_conf."""
