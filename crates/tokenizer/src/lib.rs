//! quiver-tokenizer
