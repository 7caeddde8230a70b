"""The DCP-format writer (torch-free), the ``torch.save`` framing, the file layout,
and the commit / manifest / ``latest`` / verification helpers."""
