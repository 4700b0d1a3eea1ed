//! Pictures of a run, as SVG: the [timeline](timeline_svg) of a demo or bench run (each chunk's
//! compute and write batch, the last chunk's computed moment, the decode side's completion and
//! the exposed tail between them, pipelined beside monolithic) and the
//! [chunk-size sweep](sweep_svg) of `kvpipe bench pipeline`.
//!
//! Drawn with `plotters`' SVG backend (no system libraries). That backend writes no ids or
//! classes, so every element a reader or a test looks for (bars, markers, points) gets a colour
//! of its own, and the picture records, as it draws, what each element of that colour is; after
//! rendering, `Tags::apply` gives each one an `id`, a `class`, `data-*` attributes (times in
//! ms) and a `<title>` that browsers show on hover. An element count that does not match what
//! was drawn is an error, never a silently misnamed picture.

use std::collections::VecDeque;
use std::fmt::Write as _;

use plotters::style::RGBColor;
use thiserror::Error;

mod sweep;
mod timeline;

pub(crate) use sweep::{sweep_svg, SweepPoint};
pub(crate) use timeline::{timeline_svg, TimelinePanel};

/// Why a picture could not be drawn.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub(crate) enum PictureError {
    /// The plotting library refused a drawing operation.
    #[error("drawing the picture failed: {0}")]
    Draw(String),
    /// There is nothing to draw.
    #[error("nothing to draw: {0}")]
    Empty(&'static str),
    /// The SVG held another number of elements of a colour than were drawn.
    #[error("the SVG holds {found} <{element}> elements of colour {colour}, {drawn} were drawn")]
    Tagging {
        /// The element name.
        element: &'static str,
        /// Its colour.
        colour: String,
        /// How many were drawn.
        drawn: usize,
        /// How many the SVG holds.
        found: usize,
    },
}

fn draw_err(e: impl std::fmt::Display) -> PictureError {
    PictureError::Draw(e.to_string())
}

/// A chunk's compute.
const COMPUTE: RGBColor = RGBColor(0x4C, 0x72, 0xB0);
/// A write batch in flight; the monolithic series.
const TRANSFER: RGBColor = RGBColor(0xDD, 0x84, 0x52);
/// The last chunk's computed moment.
const LAST_COMPUTED: RGBColor = RGBColor(0x44, 0x44, 0x44);
/// The decode side's completion.
const COMPLETED: RGBColor = RGBColor(0x2E, 0x8B, 0x3E);
/// The exposed tail.
const TAIL: RGBColor = RGBColor(0xC4, 0x2E, 0x3A);

fn hex(c: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// What one drawn element is.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Tag {
    /// Unique in the picture.
    pub(crate) id: String,
    /// What kind of element it is (`compute`, `transfer`, ...).
    pub(crate) class: &'static str,
    /// Shown on hover.
    pub(crate) title: String,
    /// `data-*` attributes (name without the prefix, value).
    pub(crate) data: Vec<(&'static str, String)>,
}

/// The elements of a picture that get names, per (element, colour), in drawing order.
#[derive(Debug, Default)]
pub(crate) struct Tags {
    queues: Vec<((&'static str, String), VecDeque<Tag>)>,
}

impl Tags {
    /// Records that the next `<element>` of `colour` drawn is `tag` (`rect`s and `circle`s are
    /// matched by fill, `polyline`s by stroke).
    pub(crate) fn push(&mut self, element: &'static str, colour: RGBColor, tag: Tag) {
        let key = (element, hex(colour));
        match self.queues.iter_mut().find(|(k, _)| *k == key) {
            Some((_, q)) => q.push_back(tag),
            None => self.queues.push((key, VecDeque::from([tag]))),
        }
    }

    /// Names the recorded elements of `svg` (as the SVG backend writes it: one element per
    /// line).
    pub(crate) fn apply(mut self, svg: &str) -> Result<String, PictureError> {
        let drawn: Vec<usize> = self.queues.iter().map(|(_, q)| q.len()).collect();
        let mut found = vec![0; self.queues.len()];
        let mut out = String::with_capacity(svg.len() * 2);
        for line in svg.split_inclusive('\n') {
            let named = (|| {
                let body = line.trim_end().strip_suffix("/>")?;
                let element = body.strip_prefix('<')?.split(' ').next()?;
                let paint = if element == "polyline" {
                    "stroke"
                } else {
                    "fill"
                };
                let colour = attribute(body, paint)?;
                let i = self
                    .queues
                    .iter()
                    .position(|((e, c), _)| *e == element && *c == colour)?;
                found[i] += 1;
                let tag = self.queues[i].1.pop_front()?;
                Some(named_element(body, element, &tag))
            })();
            out.push_str(named.as_deref().unwrap_or(line));
        }
        for ((((element, colour), _), drawn), found) in self.queues.iter().zip(drawn).zip(found) {
            if drawn != found {
                return Err(PictureError::Tagging {
                    element,
                    colour: colour.clone(),
                    drawn,
                    found,
                });
            }
        }
        Ok(out)
    }
}

/// The value of attribute `name` in an element's text.
fn attribute<'a>(element: &'a str, name: &str) -> Option<&'a str> {
    let start = element.find(&format!(" {name}=\""))? + name.len() + 3;
    let len = element[start..].find('"')?;
    Some(&element[start..start + len])
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `<element ...>` with the tag's names, its title inside.
fn named_element(body: &str, element: &str, tag: &Tag) -> String {
    let mut s = String::from(body);
    let _ = write!(s, " id=\"{}\" class=\"{}\"", escape(&tag.id), tag.class);
    for (k, v) in &tag.data {
        let _ = write!(s, " data-{k}=\"{}\"", escape(v));
    }
    let _ = writeln!(s, "><title>{}</title></{element}>", escape(&tag.title));
    s
}

#[cfg(test)]
mod tests {
    use kvpipe_core::{Duration, Instant, RequestId};

    use super::*;
    use kvpipe_conformance::suite::timeline::{BatchSpan, ChunkTiming, Lane, Timeline};

    fn tag(id: &str) -> Tag {
        Tag {
            id: id.into(),
            class: "compute",
            title: "a <bar> & more".into(),
            data: vec![("chunk", "0".into())],
        }
    }

    #[test]
    fn tags_name_the_elements_of_their_colour_in_drawing_order() {
        let svg = "<svg>\n<rect x=\"1\" fill=\"#4C72B0\" stroke=\"none\"/>\n\
                   <rect x=\"2\" fill=\"#FFFFFF\" stroke=\"none\"/>\n\
                   <rect x=\"3\" fill=\"#4C72B0\" stroke=\"none\"/>\n</svg>\n";
        let mut tags = Tags::default();
        tags.push("rect", COMPUTE, tag("a"));
        tags.push("rect", COMPUTE, tag("b"));
        let out = tags.apply(svg).unwrap();
        let doc = roxmltree::Document::parse(&out).unwrap();
        let ids: Vec<(&str, &str)> = doc
            .descendants()
            .filter_map(|n| Some((n.attribute("x")?, n.attribute("id")?)))
            .collect();
        assert_eq!(ids, [("1", "a"), ("3", "b")]);
        let title = doc.descendants().find(|n| n.has_tag_name("title")).unwrap();
        assert_eq!(title.text(), Some("a <bar> & more"));
    }

    #[test]
    fn a_count_that_does_not_match_the_drawing_is_an_error() {
        let svg = "<svg>\n<rect x=\"1\" fill=\"#4C72B0\" stroke=\"none\"/>\n</svg>\n";
        for drawn in [0, 2] {
            let mut tags = Tags::default();
            tags.push("polyline", TAIL, tag("unused"));
            for i in 0..drawn {
                tags.push("rect", COMPUTE, tag(&i.to_string()));
            }
            let err = tags.apply(svg).unwrap_err();
            assert!(matches!(err, PictureError::Tagging { .. }), "{err}");
        }
    }

    fn lane(request: u64, chunks: u64) -> Lane {
        let ms = Instant::from_millis;
        Lane {
            rank: 0,
            request: RequestId(request),
            origin: ms(0),
            chunks: (0..chunks)
                .map(|k| ChunkTiming {
                    index: k as u32,
                    tokens: (k as u32 * 8, k as u32 * 8 + 8),
                    layers: None,
                    compute_started: ms(10 * k),
                    computed: ms(10 * k + 8),
                    submitted: Some(ms(10 * k + 8)),
                    sliced: true,
                    batch: Some(BatchSpan {
                        bytes: 1 << 20,
                        issued: ms(10 * k + 8),
                        reported: ms(10 * k + 11),
                        transfer: Duration::from_millis(2),
                        copied: ms(10 * k + 10),
                    }),
                })
                .collect(),
            last_computed: Some(ms(10 * chunks - 2)),
            completed: Some(ms(10 * chunks + 2)),
        }
    }

    #[test]
    fn the_timeline_names_every_bar_and_labels_the_tail() {
        let t = Timeline {
            lanes: vec![lane(1, 3), lane(2, 4)],
            unpaired_batches: 0,
        };
        let panel = TimelinePanel {
            name: "pipelined",
            description: "test",
            timeline: &t,
        };
        let svg = timeline_svg("title", &[panel]).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let count = |class: &str| {
            doc.descendants()
                .filter(|n| n.attribute("class") == Some(class))
                .count()
        };
        assert_eq!(count("compute"), 7);
        assert_eq!(count("transfer"), 7);
        assert_eq!(count("tail"), 2);
        let texts: Vec<&str> = doc
            .descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text().map(str::trim))
            .collect();
        assert!(texts.contains(&"exposed tail 4.0 ms"), "{texts:?}");
        assert!(
            texts.iter().any(|t| t.contains("4.00 ms median")),
            "{texts:?}"
        );
        let empty = Timeline::default();
        let panel = TimelinePanel {
            timeline: &empty,
            ..panel
        };
        assert!(matches!(
            timeline_svg("title", &[panel]),
            Err(PictureError::Empty(_))
        ));
    }
}
