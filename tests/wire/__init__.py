"""The wire: ttrpc framing, the multiplexer, the transport, message conversion, rejections and
the generated protocol."""
