"""The local mesh: every tokenmesh process on one machine under supervisord (`make up`)."""
