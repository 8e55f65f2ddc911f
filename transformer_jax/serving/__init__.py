"""Serving a trained model: dynamic batching over compiled shapes (`batching`) behind an HTTP API (`http`)."""
