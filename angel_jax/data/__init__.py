"""The data: token shards and their resumable iterator (shards.py), the files a source names and their documents
(sources.py), instruction records as marked rows (instructions.py), a Hugging Face tokenizer (hf_tokenizer.py) and
the marks carried in token ids (marks.py). Import the module you need; this package imports nothing itself."""
