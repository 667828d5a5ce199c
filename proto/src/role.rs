//! [`Role`]: what a worker does in a disaggregated cluster, and its `baton.worker.v1` form.
//! The worker announces it when it registers; the router sorts workers into pools by it.

use crate::wire::WireError;
use crate::worker as pb;

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Computes prompts and hands their KV off.
    Prefill,
    /// Receives KV and generates.
    Decode,
    /// Does both (also the target of a recompute or a short prompt).
    Unified,
}

impl Role {
    /// Whether it can compute a prompt for a hand-off.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Unified)
    }

    /// Whether it can generate (and so receive KV or run a whole request).
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Unified)
    }

    /// The config/CLI name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Unified => "unified",
        }
    }

    /// The wire enum.
    pub fn to_wire(self) -> pb::Role {
        match self {
            Role::Prefill => pb::Role::Prefill,
            Role::Decode => pb::Role::Decode,
            Role::Unified => pb::Role::Unified,
        }
    }

    /// From the wire's `role` field; a value that names no role (including the enum's
    /// unspecified zero) is malformed.
    pub fn from_wire(role: i32) -> Result<Role, WireError> {
        match pb::Role::try_from(role) {
            Ok(pb::Role::Prefill) => Ok(Role::Prefill),
            Ok(pb::Role::Decode) => Ok(Role::Decode),
            Ok(pb::Role::Unified) => Ok(Role::Unified),
            _ => Err(WireError(format!("unknown role {role}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_round_trip_and_unknown_values_are_errors() {
        for r in [Role::Prefill, Role::Decode, Role::Unified] {
            assert_eq!(Role::from_wire(r.to_wire() as i32), Ok(r));
        }
        assert!(Role::from_wire(0).is_err(), "the unspecified zero names no role");
        assert!(Role::from_wire(99).is_err());
        assert_eq!((Role::Unified.prefills(), Role::Unified.decodes()), (true, true));
        assert_eq!((Role::Prefill.decodes(), Role::Decode.prefills()), (false, false));
    }
}
