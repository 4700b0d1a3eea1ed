//! Framing for byte-stream transports, without I/O.
//!
//! A connection's reader owns one [`StreamReader`]. It asks [`StreamReader::read_into`] where
//! the next bytes from the socket go — the frame being assembled, admitted destination memory,
//! or nowhere (a payload being discarded) — reads at most that many bytes there, and reports
//! how many with [`StreamReader::advance`], which says what a completed read means:
//!
//! - [`StreamEvent::Frame`]: a whole control frame; hand it to the endpoint as
//!   [`TransportInput::FrameReceived`](crate::session::TransportInput::FrameReceived);
//! - [`StreamEvent::DataWrite`]: a data write's header, decoded here once; hand it to the
//!   endpoint's [`admit_write`](crate::session::Endpoint::admit_write) and pass the answer to
//!   [`StreamReader::admitted`] (the payload is then read into memory, discarded, or — refused —
//!   the connection stops);
//! - [`StreamEvent::Landed`]: an admitted payload is all in memory; report
//!   [`TransportInput::WriteFinished`](crate::session::TransportInput::WriteFinished).
//!
//! The reader never trusts a length: a header is checked (magic, kind, flags, the kind's body
//! cap, and the connection's body limit — [`StreamReader::set_body_limit`], a handshake's until
//! the endpoint's [`frame_body_limit`](crate::session::Endpoint::frame_body_limit) says the
//! peer completed it) before its body is read, and a body buffer grows with the bytes that
//! actually arrived, so a peer announcing a large body it never sends costs nothing. A data
//! write's body is decoded as soon as it is whole (the endpoint gets the typed
//! [`DataWrite`], never its bytes). A header that fails the check, or a data write whose body
//! does not decode, stops the stream; its bytes come with the error ([`StreamError::Header`])
//! for the transport to hand to the endpoint as a frame, which decodes them, finds the same
//! error and fails the peer with a protocol error. The blocking and async shells of a
//! transport run the same reader; only their `read` calls differ.

use bytes::Bytes;
use thiserror::Error;

use crate::ids::RegionId;
use crate::session::{Admission, WriteRefusal, WriteTicket};
use crate::wire::{
    DataWrite, DecodeError, FrameHeader, FrameKind, HEADER_LEN, MAX_HANDSHAKE_BODY_LEN,
    MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};

// A data write's header is checked here at the versions this build speaks, and the endpoint
// takes the decoded value without its version; control frames are checked by the endpoint at
// the version negotiated with the peer. While this build speaks one version the two checks
// are the same. A build that speaks a second must have the reader check data writes at the
// negotiated version before it compiles.
const _: () = assert!(
    MIN_PROTOCOL_VERSION == PROTOCOL_VERSION,
    "StreamReader must check DataWrite headers at the negotiated version"
);

/// How much a body buffer grows per read: a peer must send bytes to make the reader hold them.
const BODY_STEP: usize = 64 << 10;

/// Where the next bytes from the stream go.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadInto<'a> {
    /// Into this buffer (part of the frame being assembled).
    Frame(&'a mut [u8]),
    /// At most `len` payload bytes into `region` at `offset`: memory the endpoint admitted for
    /// this write alone (no other admitted write overlaps it).
    Memory {
        /// Destination region.
        region: RegionId,
        /// Destination offset of the next byte.
        offset: u64,
        /// Bytes of the payload still to read.
        len: u64,
    },
    /// At most `len` bytes to read and drop.
    Discard {
        /// Bytes still to drop.
        len: u64,
    },
}

/// What a completed read means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamEvent {
    /// A whole control frame (header and body).
    Frame(Bytes),
    /// The header of a data write, decoded; its payload follows. Hand it to the endpoint's
    /// [`admit_write`](crate::session::Endpoint::admit_write) and pass the answer to
    /// [`StreamReader::admitted`].
    DataWrite(DataWrite),
    /// An admitted payload is all in memory.
    Landed(WriteTicket),
}

/// Why a stream cannot go on.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum StreamError {
    /// A frame header that no peer speaking this protocol sends, one declaring a body over the
    /// connection's limit, or a data write whose body does not decode. Hand `bytes` to the
    /// endpoint as a frame
    /// ([`TransportInput::FrameReceived`](crate::session::TransportInput::FrameReceived)): it
    /// reports the protocol error and closes the peer.
    #[error("bad frame header: {error}")]
    Header {
        /// What is wrong with it.
        error: DecodeError,
        /// The header's bytes (a data write's: its whole frame, header and body).
        bytes: Bytes,
    },
    /// The endpoint refused a data write: nothing more is read from this connection.
    #[error("data write refused: {0}")]
    Refused(WriteRefusal),
    /// The reader was used out of order (a driver bug).
    #[error("stream reader used out of order: {0}")]
    Misuse(&'static str),
}

/// How a stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamEnd {
    /// At a frame boundary: an orderly end of stream.
    Clean,
    /// Inside a frame or payload. If an admitted payload was being read, `unfinished` is its
    /// ticket: report it finished with `landed: false`.
    Truncated {
        /// The admitted write cut short, if any.
        unfinished: Option<WriteTicket>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Header {
        filled: usize,
    },
    Body {
        total: usize,
        filled: usize,
        data: bool,
    },
    AwaitingAdmission,
    Payload {
        ticket: WriteTicket,
        region: RegionId,
        offset: u64,
        left: u64,
    },
    Discard {
        left: u64,
    },
    Stopped,
}

/// The sans-IO reading half of one stream connection (see the module doc).
#[derive(Debug)]
pub struct StreamReader {
    buf: Vec<u8>,
    state: State,
    /// The largest body accepted (on top of each kind's own cap).
    body_limit: u32,
}

impl Default for StreamReader {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamReader {
    /// A reader at the start of a stream, accepting bodies of a handshake's size
    /// ([`MAX_HANDSHAKE_BODY_LEN`]) until [`set_body_limit`](Self::set_body_limit) raises it.
    pub fn new() -> Self {
        StreamReader {
            buf: vec![0; HEADER_LEN],
            state: State::Header { filled: 0 },
            body_limit: MAX_HANDSHAKE_BODY_LEN,
        }
    }

    /// Sets the largest body the next headers may declare (each kind's own cap still applies):
    /// the endpoint's [`frame_body_limit`](crate::session::Endpoint::frame_body_limit) for the
    /// connection's peer.
    pub fn set_body_limit(&mut self, limit: u32) {
        self.body_limit = limit;
    }

    /// The largest body the next headers may declare.
    pub fn body_limit(&self) -> u32 {
        self.body_limit
    }

    /// Where the next bytes go. Read at most the slice's length (or `len`) bytes.
    pub fn read_into(&mut self) -> ReadInto<'_> {
        match self.state {
            State::Header { filled } => ReadInto::Frame(&mut self.buf[filled..HEADER_LEN]),
            State::Body { total, filled, .. } => {
                let want = total.min(filled + BODY_STEP);
                if self.buf.len() < want {
                    self.buf.resize(want, 0);
                }
                ReadInto::Frame(&mut self.buf[filled..want])
            }
            State::Payload {
                region,
                offset,
                left,
                ..
            } => ReadInto::Memory {
                region,
                offset,
                len: left,
            },
            State::Discard { left } => ReadInto::Discard { len: left },
            // Nothing may be read until the admission is known, or ever after a stop.
            State::AwaitingAdmission | State::Stopped => ReadInto::Frame(&mut []),
        }
    }

    /// `n` bytes were read into what [`read_into`](Self::read_into) returned.
    pub fn advance(&mut self, n: usize) -> Result<Option<StreamEvent>, StreamError> {
        if n == 0 {
            return Ok(None);
        }
        match self.state {
            State::Header { filled } => {
                let filled = filled + n;
                if filled > HEADER_LEN {
                    return Err(StreamError::Misuse("more header bytes than asked"));
                }
                if filled < HEADER_LEN {
                    self.state = State::Header { filled };
                    return Ok(None);
                }
                let header = FrameHeader::view(&self.buf).expect("a whole header");
                let len = header.body_len.get();
                let checked = header.check(None).and_then(|kind| {
                    if len > self.body_limit {
                        Err(DecodeError::BodyTooLong {
                            kind,
                            len,
                            max: self.body_limit,
                        })
                    } else {
                        Ok(kind)
                    }
                });
                let kind = match checked {
                    Ok(kind) => kind,
                    Err(error) => {
                        self.state = State::Stopped;
                        return Err(StreamError::Header {
                            error,
                            bytes: Bytes::copy_from_slice(&self.buf[..HEADER_LEN]),
                        });
                    }
                };
                let total = header.frame_len();
                let data = kind == FrameKind::DataWrite;
                if total == HEADER_LEN {
                    return self.complete(data).map(Some);
                }
                self.state = State::Body {
                    total,
                    filled: HEADER_LEN,
                    data,
                };
                Ok(None)
            }
            State::Body {
                total,
                filled,
                data,
            } => {
                let filled = filled + n;
                if filled > total || filled > self.buf.len() {
                    return Err(StreamError::Misuse("more body bytes than asked"));
                }
                if filled < total {
                    self.state = State::Body {
                        total,
                        filled,
                        data,
                    };
                    return Ok(None);
                }
                self.complete(data).map(Some)
            }
            State::Payload {
                ticket,
                region,
                offset,
                left,
            } => {
                let n = n as u64;
                if n > left {
                    return Err(StreamError::Misuse("more payload bytes than asked"));
                }
                if n < left {
                    self.state = State::Payload {
                        ticket,
                        region,
                        offset: offset + n,
                        left: left - n,
                    };
                    return Ok(None);
                }
                self.next_frame();
                Ok(Some(StreamEvent::Landed(ticket)))
            }
            State::Discard { left } => {
                let n = n as u64;
                if n > left {
                    return Err(StreamError::Misuse("more discarded bytes than asked"));
                }
                if n < left {
                    self.state = State::Discard { left: left - n };
                } else {
                    self.next_frame();
                }
                Ok(None)
            }
            State::AwaitingAdmission => Err(StreamError::Misuse("read before the admission")),
            State::Stopped => Err(StreamError::Misuse("read after the stream stopped")),
        }
    }

    /// The endpoint's answer to the [`StreamEvent::DataWrite`] just returned. A refusal stops
    /// the reader. An admitted write with an empty payload has landed at once: that is the
    /// [`StreamEvent::Landed`] returned.
    pub fn admitted(&mut self, admission: Admission) -> Result<Option<StreamEvent>, StreamError> {
        if self.state != State::AwaitingAdmission {
            return Err(StreamError::Misuse("admission without a data write"));
        }
        match admission {
            Admission::Apply {
                ticket,
                region,
                offset,
                len,
            } => {
                if len == 0 {
                    self.next_frame();
                    return Ok(Some(StreamEvent::Landed(ticket)));
                }
                self.state = State::Payload {
                    ticket,
                    region,
                    offset,
                    left: len,
                };
                Ok(None)
            }
            Admission::Discard { len } => {
                if len == 0 {
                    self.next_frame();
                } else {
                    self.state = State::Discard { left: len };
                }
                Ok(None)
            }
            Admission::Refuse(refusal) => {
                self.state = State::Stopped;
                Err(StreamError::Refused(refusal))
            }
        }
    }

    /// The admitted write whose payload is being read, if any (report it finished with
    /// `landed: false` if the connection fails now).
    pub fn in_flight(&self) -> Option<WriteTicket> {
        match self.state {
            State::Payload { ticket, .. } => Some(ticket),
            _ => None,
        }
    }

    /// The stream ended (the peer closed it, or it failed): how.
    pub fn end(&mut self) -> StreamEnd {
        let end = match self.state {
            State::Header { filled: 0 } => StreamEnd::Clean,
            State::Payload { ticket, .. } => StreamEnd::Truncated {
                unfinished: Some(ticket),
            },
            _ => StreamEnd::Truncated { unfinished: None },
        };
        self.state = State::Stopped;
        end
    }

    /// The frame in `buf` is whole: a control frame's bytes go to the endpoint as they are; a
    /// data write's body is decoded here, once (its header was checked in `advance`).
    fn complete(&mut self, data: bool) -> Result<StreamEvent, StreamError> {
        if !data {
            let bytes = Bytes::copy_from_slice(&self.buf);
            self.next_frame();
            return Ok(StreamEvent::Frame(bytes));
        }
        match DataWrite::parse_checked_body(&self.buf[HEADER_LEN..]) {
            Ok(write) => {
                self.buf.truncate(HEADER_LEN);
                self.state = State::AwaitingAdmission;
                Ok(StreamEvent::DataWrite(write))
            }
            Err(error) => {
                self.state = State::Stopped;
                Err(StreamError::Header {
                    error,
                    bytes: Bytes::copy_from_slice(&self.buf),
                })
            }
        }
    }

    fn next_frame(&mut self) {
        self.buf.truncate(HEADER_LEN);
        self.buf.shrink_to(BODY_STEP.max(HEADER_LEN));
        self.state = State::Header { filled: 0 };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{GrantId, RequestId};
    use crate::wire::{Frame, Heartbeat, MAX_BODY_LEN};

    /// Feeds `bytes` to `r` in pieces of at most `step`, answering data writes with `admit`.
    fn feed(
        r: &mut StreamReader,
        bytes: &[u8],
        step: usize,
        admit: &mut dyn FnMut(&DataWrite) -> Admission,
        memory: &mut Vec<(u64, Vec<u8>)>,
    ) -> Result<Vec<StreamEvent>, StreamError> {
        let mut events = Vec::new();
        let mut pos = 0;
        while pos < bytes.len() {
            let n = match r.read_into() {
                ReadInto::Frame(buf) => {
                    let n = buf.len().min(step).min(bytes.len() - pos);
                    buf[..n].copy_from_slice(&bytes[pos..pos + n]);
                    n
                }
                ReadInto::Memory { offset, len, .. } => {
                    let n = (len as usize).min(step).min(bytes.len() - pos);
                    memory.push((offset, bytes[pos..pos + n].to_vec()));
                    n
                }
                ReadInto::Discard { len } => (len as usize).min(step).min(bytes.len() - pos),
            };
            assert!(n > 0, "the reader asked for nothing");
            pos += n;
            if let Some(e) = r.advance(n)? {
                let landed = match &e {
                    StreamEvent::DataWrite(h) => r.admitted(admit(h))?,
                    _ => None,
                };
                events.push(e);
                events.extend(landed);
            }
        }
        Ok(events)
    }

    fn header(len: u64) -> DataWrite {
        DataWrite {
            request: RequestId(1),
            grant: GrantId(2),
            region: RegionId(3),
            offset: 100,
            len,
        }
    }

    fn data_write(len: u64) -> Vec<u8> {
        let mut out = Frame::DataWrite(header(len)).to_vec().unwrap();
        out.extend((0..len).map(|i| i as u8));
        out
    }

    #[test]
    fn frames_and_payloads_in_any_read_sizes() {
        let hb = Frame::Heartbeat(Heartbeat { seq: 9 }).to_vec().unwrap();
        let mut stream = hb.clone();
        stream.extend(data_write(300));
        stream.extend(hb.clone());
        stream.extend(data_write(0));
        for step in [1, 7, 64, 1 << 20] {
            let mut r = StreamReader::new();
            let mut mem = Vec::new();
            let mut t = 0;
            let mut admit = |w: &DataWrite| {
                assert_eq!(
                    *w,
                    header(if t == 0 { 300 } else { 0 }),
                    "decoded once, whole"
                );
                t += 1;
                Admission::Apply {
                    ticket: WriteTicket(t),
                    region: RegionId(3),
                    offset: 100,
                    len: if t == 1 { 300 } else { 0 },
                }
            };
            let events = feed(&mut r, &stream, step, &mut admit, &mut mem).unwrap();
            let kinds: Vec<&str> = events
                .iter()
                .map(|e| match e {
                    StreamEvent::Frame(_) => "frame",
                    StreamEvent::DataWrite(_) => "write",
                    StreamEvent::Landed(_) => "landed",
                })
                .collect();
            assert_eq!(
                kinds,
                ["frame", "write", "landed", "frame", "write", "landed"],
                "step {step}"
            );
            assert_eq!(events[0], StreamEvent::Frame(Bytes::from(hb.clone())));
            assert_eq!(events[1], StreamEvent::DataWrite(header(300)));
            let payload: Vec<u8> = mem.iter().flat_map(|(_, b)| b.clone()).collect();
            assert_eq!(payload, (0..300u64).map(|i| i as u8).collect::<Vec<_>>());
            assert_eq!(mem[0].0, 100);
            assert_eq!(r.end(), StreamEnd::Clean);
        }
    }

    #[test]
    fn discarded_and_refused_payloads() {
        let mut stream = data_write(50);
        stream.extend(Frame::Heartbeat(Heartbeat { seq: 1 }).to_vec().unwrap());
        let mut r = StreamReader::new();
        let mut mem = Vec::new();
        let events = feed(
            &mut r,
            &stream,
            16,
            &mut |_| Admission::Discard { len: 50 },
            &mut mem,
        )
        .unwrap();
        assert!(mem.is_empty());
        assert!(matches!(events.last(), Some(StreamEvent::Frame(_))));
        let mut r = StreamReader::new();
        let refused = feed(
            &mut r,
            &data_write(50),
            16,
            &mut |_| Admission::Refuse(WriteRefusal::NotAccepted),
            &mut mem,
        );
        assert_eq!(
            refused,
            Err(StreamError::Refused(WriteRefusal::NotAccepted))
        );
        assert!(r.advance(1).is_err());
    }

    #[test]
    fn bad_headers_stop_the_stream_and_bodies_grow_with_arrivals() {
        let mut r = StreamReader::new();
        let mut garbage = [0u8; HEADER_LEN];
        garbage[..4].copy_from_slice(b"HTTP");
        let err = feed(
            &mut r,
            &garbage,
            64,
            &mut |_| unreachable!(),
            &mut Vec::new(),
        );
        match err {
            Err(StreamError::Header { bytes, .. }) => assert_eq!(&bytes[..], &garbage[..]),
            other => panic!("{other:?}"),
        }
        // A Hello header announcing the largest body, followed by one byte: the reader holds a
        // buffer of one step, not the announced length.
        let header = FrameHeader::new(FrameKind::Hello, 1, MAX_BODY_LEN);
        let mut r = StreamReader::new();
        r.set_body_limit(MAX_BODY_LEN);
        feed(
            &mut r,
            &header.to_bytes(),
            64,
            &mut |_| unreachable!(),
            &mut Vec::new(),
        )
        .unwrap();
        let ReadInto::Frame(buf) = r.read_into() else {
            panic!("a body is read into the frame buffer")
        };
        assert_eq!(buf.len(), BODY_STEP);
        assert_eq!(r.end(), StreamEnd::Truncated { unfinished: None });
    }

    #[test]
    fn a_data_write_whose_body_does_not_decode_stops_the_stream_with_its_bytes() {
        // A DataWrite header declaring a 20-byte body (the body is 36): the header passes its
        // check, the body is read, and decoding it fails before the endpoint is asked.
        let mut frame = FrameHeader::new(FrameKind::DataWrite, PROTOCOL_VERSION, 20)
            .to_bytes()
            .to_vec();
        frame.extend([7u8; 20]);
        let mut stream = frame.clone();
        stream.extend([9u8; 64]); // what would have been its payload
        for step in [1, 5, 1 << 20] {
            let mut r = StreamReader::new();
            r.set_body_limit(MAX_BODY_LEN);
            let err = feed(
                &mut r,
                &stream,
                step,
                &mut |_| unreachable!("a malformed header is never admitted"),
                &mut Vec::new(),
            );
            // The endpoint, handed these bytes as a frame, finds the same error.
            let error = Frame::parse(&frame).unwrap_err();
            assert!(matches!(error, DecodeError::Malformed { .. }), "{error:?}");
            assert_eq!(
                err,
                Err(StreamError::Header {
                    error,
                    bytes: Bytes::from(frame.clone()),
                }),
                "step {step}"
            );
            assert!(r.advance(1).is_err(), "nothing is read after it");
        }
    }

    #[test]
    fn before_the_handshake_only_handshake_sized_bodies_are_read() {
        // A Hello at the handshake limit is read; one byte more is refused at its header, which
        // comes back with the error for the endpoint to judge.
        let at_limit = FrameHeader::new(FrameKind::Hello, 1, MAX_HANDSHAKE_BODY_LEN);
        let mut r = StreamReader::new();
        assert_eq!(r.body_limit(), MAX_HANDSHAKE_BODY_LEN);
        let mut stream = at_limit.to_bytes().to_vec();
        stream.resize(HEADER_LEN + MAX_HANDSHAKE_BODY_LEN as usize, 0);
        let events = feed(
            &mut r,
            &stream,
            1 << 20,
            &mut |_| unreachable!(),
            &mut Vec::new(),
        );
        assert!(matches!(events.as_deref(), Ok([StreamEvent::Frame(_)])));

        let over = FrameHeader::new(FrameKind::Hello, 1, MAX_HANDSHAKE_BODY_LEN + 1).to_bytes();
        let err = feed(&mut r, &over, 64, &mut |_| unreachable!(), &mut Vec::new());
        assert_eq!(
            err,
            Err(StreamError::Header {
                error: DecodeError::BodyTooLong {
                    kind: FrameKind::Hello,
                    len: MAX_HANDSHAKE_BODY_LEN + 1,
                    max: MAX_HANDSHAKE_BODY_LEN,
                },
                bytes: Bytes::copy_from_slice(&over),
            })
        );

        // Once the peer's handshake completed, the endpoint's limit is the largest body.
        let mut r = StreamReader::new();
        r.set_body_limit(MAX_BODY_LEN);
        assert_eq!(
            feed(&mut r, &over, 64, &mut |_| unreachable!(), &mut Vec::new()),
            Ok(vec![])
        );
    }

    #[test]
    fn a_cut_payload_names_its_ticket() {
        let stream = data_write(100);
        let mut r = StreamReader::new();
        let mut mem = Vec::new();
        let cut = &stream[..stream.len() - 10];
        feed(
            &mut r,
            cut,
            32,
            &mut |_| Admission::Apply {
                ticket: WriteTicket(7),
                region: RegionId(3),
                offset: 100,
                len: 100,
            },
            &mut mem,
        )
        .unwrap();
        assert_eq!(r.in_flight(), Some(WriteTicket(7)));
        assert_eq!(
            r.end(),
            StreamEnd::Truncated {
                unfinished: Some(WriteTicket(7))
            }
        );
    }
}
