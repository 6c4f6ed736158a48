//! quiver-quant
