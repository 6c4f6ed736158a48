//! quiver-hub
