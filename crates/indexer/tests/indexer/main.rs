//! The index against a reference model, and the sharded index.

mod reference_model;
mod sharded;
