//! Chat templates.
