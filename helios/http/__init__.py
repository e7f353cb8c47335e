"""The HTTP side: one request context, the SSE stream with keepalives, error rendering, the
dispatcher, and one module per protocol's routes. `helios.app` wires it to the model runtime."""
