"""A trained model at work: a corpus translated in shards across hosts, resumable and exactly once (`corpus`), and
requests batched dynamically onto compiled shapes (`batching`) behind an HTTP API (`http`)."""
