//! What makes a type a message: its shape in the current format version and in the previous
//! one, and the conversions between them.
//!
//! The codec writes the current version and reads the current and the previous one (rolling
//! upgrades). A type unchanged between the two is its own previous shape; a changed one names
//! its frozen previous type (in the module named after the previous version, `v7`) and
//! converts. See docs/protocol.md, "Versions".

use crate::messages::Reply;
use serde::{de::DeserializeOwned, Serialize};

/// A type the codec encodes and decodes.
///
/// A type whose fields include a changed type has changed too: it needs its own previous
/// shape, built from the changed type's.
pub trait Wire: Serialize + DeserializeOwned {
    /// The type as the previous format version encodes it (`Self` when unchanged).
    type Previous: Serialize + DeserializeOwned;

    /// Upgrades a value a previous-version peer sent: fields that version lacks get the
    /// defaults the type documents.
    fn from_previous(previous: Self::Previous) -> Self;

    /// Downgrades a value for a previous-version peer: what that version lacks is dropped.
    /// (Only answers to such peers take this path, so the clone an unchanged type makes
    /// here costs nothing in a fleet running one version.)
    fn to_previous(&self) -> Self::Previous;
}

/// Implements [`Wire`] for types whose encoding is the same in the current and the previous
/// format version.
macro_rules! unchanged_since_previous {
    ($($ty:ty),* $(,)?) => {
        $(
            impl $crate::wire::Wire for $ty {
                type Previous = Self;

                fn from_previous(previous: Self) -> Self {
                    previous
                }

                fn to_previous(&self) -> Self {
                    self.clone()
                }
            }
        )*
    };
}
pub(crate) use unchanged_since_previous;

// Plain values some endpoints take or answer (`drop_events` takes a `u64`, answers
// `Reply<()>`); their encoding is bincode's and never changes.
unchanged_since_previous!((), u64);

/// `Ok` converts its value; `ErrorReply` is the same in both versions (a version that
/// changes `ErrorReply` or `ErrorKind` converts `Err` here too).
impl<T: Wire> Wire for Reply<T> {
    type Previous = Reply<T::Previous>;

    fn from_previous(previous: Self::Previous) -> Self {
        match previous {
            Reply::Ok(v) => Reply::Ok(T::from_previous(v)),
            Reply::Err(e) => Reply::Err(e),
        }
    }

    fn to_previous(&self) -> Self::Previous {
        match self {
            Reply::Ok(v) => Reply::Ok(v.to_previous()),
            Reply::Err(e) => Reply::Err(e.clone()),
        }
    }
}

impl<T: Wire> Wire for Vec<T> {
    type Previous = Vec<T::Previous>;

    fn from_previous(previous: Self::Previous) -> Self {
        previous.into_iter().map(T::from_previous).collect()
    }

    fn to_previous(&self) -> Self::Previous {
        self.iter().map(T::to_previous).collect()
    }
}

impl<T: Wire> Wire for Option<T> {
    type Previous = Option<T::Previous>;

    fn from_previous(previous: Self::Previous) -> Self {
        previous.map(T::from_previous)
    }

    fn to_previous(&self) -> Self::Previous {
        self.as_ref().map(T::to_previous)
    }
}
