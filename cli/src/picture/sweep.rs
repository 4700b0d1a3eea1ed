//! The chunk-size sweep of `kvpipe bench pipeline --sweep-chunk-tokens … --plot FILE.svg`: the
//! exposed tail (left) and the time spent moving bytes (right) against the chunk size,
//! pipelined and monolithic.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Serialize;

use super::{draw_err, PictureError, Tag, Tags, COMPUTE, TRANSFER};

/// The figures of one chunk size.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub(crate) struct SweepPoint {
    /// Tokens per prefill chunk.
    pub(crate) chunk_tokens: u32,
    /// Pipelined: median exposed tail (last chunk computed → decode side complete), ms.
    pub(crate) exposed_tail_ms: f64,
    /// Monolithic: median exposed tail, ms.
    pub(crate) monolithic_tail_ms: f64,
    /// Pipelined: median over runs of the write batches' copy times summed, ms.
    pub(crate) transfer_ms: f64,
    /// Monolithic: the same, ms.
    pub(crate) monolithic_transfer_ms: f64,
}

const WIDTH: u32 = 1200;
const HEIGHT: u32 = 520;
const HEADER: u32 = 74;
const FONT: &str = "sans-serif";
const INK: RGBColor = RGBColor(0x22, 0x22, 0x22);
const MUTED: RGBColor = RGBColor(0x66, 0x66, 0x66);
const GRID: RGBColor = RGBColor(0xE4, 0xE4, 0xE4);

/// Draws `points` (in the order given, one x position each) under `title` as an SVG document.
pub(crate) fn sweep_svg(title: &str, points: &[SweepPoint]) -> Result<String, PictureError> {
    if points.is_empty() {
        return Err(PictureError::Empty("the sweep has no chunk sizes"));
    }
    let sizes: Vec<u32> = points.iter().map(|p| p.chunk_tokens).collect();
    let mut tags = Tags::default();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let (header, body) = root.split_vertically(HEADER);
        header
            .draw(&Text::new(
                title.to_string(),
                (16, 12),
                (FONT, 20).into_font().style(FontStyle::Bold).color(&INK),
            ))
            .map_err(draw_err)?;
        let mut x = 16;
        for (colour, label, series) in [
            (
                COMPUTE,
                "pipelined (each chunk sent when computed)",
                "pipelined",
            ),
            (
                TRANSFER,
                "monolithic (everything sent after prefill)",
                "monolithic",
            ),
        ] {
            header
                .draw(&PathElement::new(
                    vec![(x, 52), (x + 26, 52)],
                    colour.stroke_width(3),
                ))
                .map_err(draw_err)?;
            tags.push(
                "polyline",
                colour,
                Tag {
                    id: format!("legend-{series}"),
                    class: "legend",
                    title: format!("legend: {series}"),
                    data: Vec::new(),
                },
            );
            header
                .draw(&Text::new(
                    label,
                    (x + 34, 52),
                    (FONT, 16)
                        .into_font()
                        .color(&INK)
                        .pos(Pos::new(HPos::Left, VPos::Center)),
                ))
                .map_err(draw_err)?;
            x += 34 + label.len() as i32 * 8 + 30;
        }
        let halves = body.split_evenly((1, 2));
        let figures = [
            Half {
                caption: "exposed tail (last chunk computed → decode side complete)",
                figure: "tail",
                values: |p| (p.exposed_tail_ms, p.monolithic_tail_ms),
            },
            Half {
                caption: "time moving bytes (write batches' copy times, summed)",
                figure: "transfer",
                values: |p| (p.transfer_ms, p.monolithic_transfer_ms),
            },
        ];
        for (area, half) in halves.iter().zip(&figures) {
            draw_half(area, &root, &sizes, points, half, &mut tags)?;
        }
        root.present().map_err(draw_err)?;
    }
    tags.apply(&svg)
}

/// One of the two figures.
struct Half<'a> {
    caption: &'a str,
    /// Its name in ids and `data-figure`.
    figure: &'static str,
    /// (pipelined, monolithic) of a point.
    values: fn(&SweepPoint) -> (f64, f64),
}

fn draw_half(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    sizes: &[u32],
    points: &[SweepPoint],
    half: &Half<'_>,
    tags: &mut Tags,
) -> Result<(), PictureError> {
    let Half {
        caption,
        figure,
        values,
    } = *half;
    let top = points
        .iter()
        .map(|p| {
            let (a, b) = values(p);
            a.max(b)
        })
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 18).into_font().color(&INK))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(
            (0..sizes.len() as i32 - 1).into_segmented(),
            0f64..top * 1.15,
        )
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("tokens per prefill chunk")
        .y_desc("ms")
        .x_labels(sizes.len())
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => sizes
                .get(*i as usize)
                .map_or(String::new(), ToString::to_string),
            _ => String::new(),
        })
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 15).into_font().color(&INK))
        .axis_desc_style((FONT, 15).into_font().color(&MUTED))
        .light_line_style(WHITE)
        .bold_line_style(GRID)
        .draw()
        .map_err(draw_err)?;
    for (series, colour, pick) in [("pipelined", COMPUTE, 0usize), ("monolithic", TRANSFER, 1)] {
        let at = |p: &SweepPoint| {
            let (a, b) = values(p);
            if pick == 0 {
                a
            } else {
                b
            }
        };
        chart
            .draw_series(LineSeries::new(
                (0i32..)
                    .zip(points)
                    .map(|(i, p)| (SegmentValue::CenterOf(i), at(p))),
                colour.stroke_width(3),
            ))
            .map_err(draw_err)?;
        tags.push(
            "polyline",
            colour,
            Tag {
                id: format!("{figure}-{series}"),
                class: "series",
                title: format!("{series}: {figure} against the chunk size"),
                data: vec![("figure", figure.into()), ("series", series.into())],
            },
        );
        for (i, p) in (0i32..).zip(points) {
            let v = at(p);
            let coord = (SegmentValue::CenterOf(i), v);
            chart
                .draw_series(std::iter::once(Circle::new(
                    coord.clone(),
                    5,
                    colour.filled(),
                )))
                .map_err(draw_err)?;
            tags.push(
                "circle",
                colour,
                Tag {
                    id: format!("{figure}-{series}-{}", p.chunk_tokens),
                    class: "point",
                    title: format!(
                        "{series}, chunks of {} tokens: {figure} {v:.2} ms",
                        p.chunk_tokens
                    ),
                    data: vec![
                        ("figure", figure.into()),
                        ("series", series.into()),
                        ("chunk-tokens", p.chunk_tokens.to_string()),
                        ("ms", format!("{v:.3}")),
                    ],
                },
            );
            // The higher point's label above it, the lower one's below (above when that would
            // touch the axis), so that close values stay apart.
            let (a, b) = values(p);
            let higher = if pick == 0 { a > b } else { b >= a };
            let (px, py) = chart.backend_coord(&coord);
            let (_, axis) = chart.backend_coord(&(SegmentValue::CenterOf(i), 0.0));
            let (dy, v_pos) = if higher || py + 28 > axis {
                (-10, VPos::Bottom)
            } else {
                (10, VPos::Top)
            };
            root.draw(&Text::new(
                format!("{v:.1}"),
                (px, py + dy),
                (FONT, 15)
                    .into_font()
                    .color(&colour)
                    .pos(Pos::new(HPos::Center, v_pos)),
            ))
            .map_err(draw_err)?;
        }
    }
    Ok(())
}
