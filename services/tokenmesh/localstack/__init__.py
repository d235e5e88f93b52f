"""The local stack: every tokenmesh process on one machine under supervisord (`make up`)."""
