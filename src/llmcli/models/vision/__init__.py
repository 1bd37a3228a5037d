"""Images into a vision-language model: reading and checking an image's bytes (image_file.py),
and each family's vision tower and projector (one module each), which turn an image into the
rows of embeddings the decoder reads where the prompt holds the image's placeholder tokens."""
