//! The phases of a route on a replica, timed for `kvrouter_route_phase_seconds{model,phase}`.

use kvrouter_admin::phase_timing::{Phase, PhaseClock};

/// A route's phases, in order. `queue` is the part of `schedule` the request waited in the
/// scheduler's queue for a worker to free up.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RoutePhase {
    /// The bus message decoded (the JSON API: the body parsed).
    Decode,
    /// The prompt's block hashes computed.
    Hash,
    /// Overlaps looked up in this replica's index.
    IndexLocal,
    /// Overlaps asked of a serving indexer (`--use-remote-indexer`).
    IndexRemote,
    /// The scheduler actor's round trip, its queue wait excepted.
    Schedule,
    Queue,
    /// The answer encoded.
    Encode,
}

impl Phase for RoutePhase {
    const ALL: &'static [Self] = &[
        Self::Decode,
        Self::Hash,
        Self::IndexLocal,
        Self::IndexRemote,
        Self::Schedule,
        Self::Queue,
        Self::Encode,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Self::Decode => "decode",
            Self::Hash => "hash",
            Self::IndexLocal => "index_local",
            Self::IndexRemote => "index_remote",
            Self::Schedule => "schedule",
            Self::Queue => "queue",
            Self::Encode => "encode",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

pub type RouteClock = PhaseClock<RoutePhase>;
