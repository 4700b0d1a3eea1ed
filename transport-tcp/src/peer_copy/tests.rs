//! The peer-copy records, the located sources and the evaluation of offers and answers.

use super::*;
use crate::memory::MemoryRegion;

fn entry(region: u32) -> OfferEntry {
    let mut handle = [0u8; HANDLE_LEN];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = (i as u8) ^ (region as u8);
    }
    OfferEntry {
        region: RegionId(region),
        ordinal: region % 2,
        handle,
    }
}

#[test]
fn offers_and_answers_round_trip() {
    let offer = Offer::Regions(vec![entry(1000), entry(1001)]);
    let bytes = offer.encode();
    assert_eq!(bytes.len(), 8 + 2 * ENTRY_LEN);
    assert_eq!(bytes[4], 2, "version 2: the receiver pulls");
    assert_eq!(Offer::decode(&bytes).unwrap(), offer);
    let no = Offer::Declined("the sender cannot export: r1 is host memory".into());
    assert_eq!(Offer::decode(&no.encode()).unwrap(), no);
    assert_eq!(Answer::encode(&Answer::Accepted).len(), 8);
    assert_eq!(Answer::decode(&Answer::Accepted.encode()), Answer::Accepted);
    let why = Answer::Declined("r1 (GPU 0 of the peer) does not open here".into());
    assert_eq!(Answer::decode(&why.encode()), why);
    // A long reason is cut at a character boundary.
    let long = Answer::Declined("é".repeat(MAX_REASON));
    let Answer::Declined(cut) = Answer::decode(&long.encode()) else {
        panic!("declined");
    };
    assert!(cut.len() <= MAX_REASON && cut.chars().all(|c| c == 'é'));
    // The largest offer fits a Hello's data-path section.
    let most = Offer::Regions((0..MAX_OFFER_REGIONS as u32).map(entry).collect());
    assert!(most.encode().len() <= MAX_DATA_PATH_LEN);
    assert_eq!(Offer::decode(&most.encode()).unwrap(), most);
}

#[test]
fn malformed_offers_are_refused_and_malformed_answers_decline() {
    let bytes = Offer::Regions(vec![entry(7)]).encode();
    // Wrong magic, version, status.
    for (at, v) in [(0, b'X'), (4, 9), (5, 2)] {
        let mut b = bytes.clone();
        b[at] = v;
        assert!(Offer::decode(&b).is_err(), "byte {at}");
    }
    // A region count past the cap, a body that is not whole entries, a short head.
    let mut b = bytes.clone();
    b[6..8].copy_from_slice(&(MAX_OFFER_REGIONS as u16 + 1).to_le_bytes());
    assert!(Offer::decode(&b).unwrap_err().contains("at most"));
    assert!(Offer::decode(&bytes[..bytes.len() - 1]).is_err());
    assert!(Offer::decode(&bytes[..5]).is_err());
    assert!(Offer::decode(&[]).is_err());
    // An accepted answer carries no reason; a status is 0 or 1; an empty answer (a
    // transport that takes no offers) declines.
    let mut a = Answer::Accepted.encode();
    a[6] = 1;
    a.push(b'x');
    assert!(matches!(Answer::decode(&a), Answer::Declined(_)));
    let mut a = Answer::Accepted.encode();
    a[5] = 2;
    assert!(matches!(Answer::decode(&a), Answer::Declined(_)));
    assert!(matches!(Answer::decode(&[]), Answer::Declined(_)));
}

#[test]
fn a_version_1_peer_is_named_as_such() {
    // Version 1: the receiver offered its own regions and the sender copied into them.
    let mut b = Offer::Regions(vec![entry(7)]).encode();
    b[4] = 1;
    let e = Offer::decode(&b).unwrap_err();
    assert!(e.contains("version 1") && e.contains("version 2"), "{e}");
    let mut a = Answer::Accepted.encode();
    a[4] = 1;
    let Answer::Declined(e) = Answer::decode(&a) else {
        panic!("declined");
    };
    assert!(e.contains("version 1"), "{e}");
}

#[test]
fn the_answer_places_the_senders_link() {
    let offered = Offer::Regions(vec![entry(1)]);
    let declined = Offer::Declined("host memory".into());
    let yes = Answer::Accepted.encode();
    let no = Answer::Declined("no GPU here".into()).encode();
    assert_eq!(peer_pulls(Some(&yes), &offered), Ok(()));
    assert_eq!(peer_pulls(Some(&no), &offered).unwrap_err(), "no GPU here");
    assert!(peer_pulls(Some(&yes), &declined).is_err());
    assert!(peer_pulls(None, &offered)
        .unwrap_err()
        .contains("answered no"));
    assert!(peer_pulls(Some(b""), &offered).is_err());
}

#[test]
fn sources_and_acknowledgements_round_trip_and_never_look_like_frames() {
    let s = Source {
        region: RegionId(0x0102_0304),
        offset: 0x1122_3344_5566_7788,
    };
    let b = s.encode();
    assert_eq!(b.len(), SOURCE_LEN);
    assert_eq!(Source::decode(&b), Some(s));
    let mut bad = b;
    bad[5] = 1;
    assert_eq!(Source::decode(&bad), None, "reserved bytes must be zero");

    assert_eq!(decode_ack(&encode_ack(3)), Some(3));
    assert_eq!(decode_ack(&encode_ack(u32::MAX)), Some(u32::MAX));
    assert_eq!(decode_ack(&encode_ack(0)), None, "acknowledges nothing");
    // A frame's first bytes are no acknowledgement.
    let frame = kvpipe_core::wire::Frame::Heartbeat(kvpipe_core::wire::Heartbeat { seq: 1 })
        .to_vec()
        .unwrap();
    let head: [u8; ACK_LEN] = frame[..ACK_LEN].try_into().unwrap();
    assert_eq!(decode_ack(&head), None);
    assert_ne!(ACK_MAGIC, kvpipe_core::wire::MAGIC);
}

#[test]
fn sources_outside_the_exported_region_are_not_located() {
    let m = PeerMappings::fake([(
        RegionId(4),
        PlacedRegion {
            ordinal: 1,
            ptr: 0x1000,
            len: 256,
        },
    )]);
    let at = |region, offset| Source {
        region: RegionId(region),
        offset,
    };
    assert_eq!(m.locate(at(4, 16), 240), Some((1, 0x1010)));
    assert_eq!(m.locate(at(4, 16), 241), None);
    assert_eq!(m.locate(at(4, u64::MAX), 2), None);
    assert_eq!(m.locate(at(5, 0), 1), None);
}

#[test]
fn a_declined_offer_is_not_accepted_and_says_why() {
    let regions = RegionTable::new();
    let why = accept(&Offer::Declined("no device".into()), &regions).unwrap_err();
    assert!(why.contains("no device"), "{why}");
    let why = accept(&Offer::Regions(vec![]), &regions).unwrap_err();
    assert!(why.contains("no region"), "{why}");
}

#[test]
fn host_memory_on_either_side_falls_back() {
    let mut host = RegionTable::new();
    host.insert(RegionId(3), MemoryRegion::zeroed(16));
    // A sender declines to export host memory, or any region with the socket path.
    for (path, want) in [
        (TcpDataPath::Auto, "host memory"),
        (TcpDataPath::PeerCopy, "host memory"),
        (TcpDataPath::Socket, "socket data path"),
    ] {
        match local_offer(path, &host) {
            Offer::Declined(why) => assert!(why.contains(want), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    // A receiver with host memory (or no receiver, or the socket path) cannot pull.
    assert!(can_pull(TcpDataPath::Auto, true, &host).is_err());
    assert!(can_pull(TcpDataPath::Auto, false, &host).is_err());
    assert!(can_pull(TcpDataPath::Socket, true, &host).is_err());
    let why = accept(&Offer::Regions(vec![entry(1)]), &host).unwrap_err();
    assert!(why.contains("host memory"), "{why}");
    let offer = Offer::Regions(vec![entry(1)]).encode();
    let why = evaluate(&offer, TcpDataPath::Auto, true, &host).unwrap_err();
    assert!(why.contains("host memory"), "{why}");
    let why = evaluate(&offer, TcpDataPath::Auto, false, &host).unwrap_err();
    assert!(why.contains("not a receiver"), "{why}");
}
