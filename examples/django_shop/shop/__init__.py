"""The shop app: orders, and the receipt job each order sends."""
