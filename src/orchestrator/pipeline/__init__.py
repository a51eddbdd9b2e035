"""The step boundary: advantages, filters, batch assembly and step outputs, all run off the event loop."""
