"""Text in and out: the tokenizer (tokenizer.json, GGUF vocabularies), prompts to padded id
batches, chat templates, and streaming detokenization."""
