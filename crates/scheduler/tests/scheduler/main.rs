//! The scheduler: its choice, and against a reference model.

mod choice;
mod reference_model;
