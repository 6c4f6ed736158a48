//! quiver-synth
