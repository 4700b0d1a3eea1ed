//! The full state × event table of both endpoints' session phases, snapshotted.

use kvpipe_core::session::state::{
    transition_table, RecvEvent, RecvPhase, SendEvent, SendPhase, Transition,
};

#[test]
fn transition_table_snapshot() {
    insta::assert_snapshot!(transition_table());
}

#[test]
fn retired_refuses_everything_and_only_quiesced_phases_retire() {
    for e in SendEvent::ALL {
        assert_eq!(SendPhase::Retired.on(e), Transition::Refused);
    }
    for e in RecvEvent::ALL {
        assert_eq!(RecvPhase::Retired.on(e), Transition::Refused);
    }
    for p in SendPhase::ALL {
        let retires = matches!(p.on(SendEvent::Retire), Transition::To(SendPhase::Retired));
        assert_eq!(
            retires,
            matches!(p, SendPhase::Completed | SendPhase::Quiesced),
            "{p:?}"
        );
    }
    for p in RecvPhase::ALL {
        let retires = matches!(p.on(RecvEvent::Retire), Transition::To(RecvPhase::Retired));
        assert_eq!(
            retires,
            matches!(p, RecvPhase::Completed | RecvPhase::Quiesced),
            "{p:?}"
        );
    }
}

#[test]
fn stopping_is_left_only_by_draining() {
    for e in SendEvent::ALL {
        let t = SendPhase::Stopping.on(e);
        if e == SendEvent::Drained {
            assert_eq!(t, Transition::To(SendPhase::Quiesced));
        } else {
            assert!(
                !matches!(t, Transition::To(p) if p != SendPhase::Stopping),
                "{e:?}"
            );
        }
    }
    for e in RecvEvent::ALL {
        let t = RecvPhase::Stopping.on(e);
        if e == RecvEvent::Drained {
            assert_eq!(t, Transition::To(RecvPhase::Quiesced));
        } else {
            assert!(
                !matches!(t, Transition::To(p) if p != RecvPhase::Stopping),
                "{e:?}"
            );
        }
    }
}
