//! The timeline picture: one panel per run (pipelined, then the monolithic baseline), one lane
//! per request (and rank); in each lane every chunk's compute as a bar with its write batch as
//! a bar under it, the last chunk's computed moment and the decode side's completion as marks,
//! and the exposed tail between them labelled in ms. The panels share one time axis, so the
//! runs compare by eye.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{draw_err, PictureError, Tag, Tags, COMPLETED, COMPUTE, LAST_COMPUTED, TAIL, TRANSFER};
use kvpipe_conformance::suite::demo::median;
use kvpipe_conformance::suite::timeline::{Lane, Timeline};

/// One run, drawn as one panel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TimelinePanel<'a> {
    /// Its name (`pipelined`, `monolithic`): the panel's heading and its elements' `data-panel`.
    pub(crate) name: &'a str,
    /// What the run did, after the name in the heading.
    pub(crate) description: &'a str,
    /// Its lanes.
    pub(crate) timeline: &'a Timeline,
}

const WIDTH: u32 = 1200;
const HEADER: u32 = 78;
const LABELS: u32 = 130;
const MARGIN_RIGHT: u32 = 24;
/// Room right of the last completion for the tail's label, in pixels.
const LABEL_ROOM: f64 = 190.0;
const FONT: &str = "sans-serif";
/// Alternate lanes' background.
const SHADE: RGBColor = RGBColor(0xF3, 0xF5, 0xF8);
const GRID: RGBColor = RGBColor(0xE4, 0xE4, 0xE4);
const INK: RGBColor = RGBColor(0x22, 0x22, 0x22);
const MUTED: RGBColor = RGBColor(0x66, 0x66, 0x66);

/// Where a lane's pieces sit, as fractions of the lane's height from its top.
const COMPUTE_ROW: (f64, f64) = (0.10, 0.44);
const TRANSFER_ROW: (f64, f64) = (0.54, 0.88);
const TAIL_ROW: f64 = 0.49;

fn lane_height(lanes: usize) -> u32 {
    match lanes {
        0..=4 => 58,
        5..=8 => 44,
        _ => 30,
    }
}

fn panel_height(lanes: usize) -> u32 {
    36 + lanes as u32 * lane_height(lanes) + 48
}

/// The median exposed tail of a run's lanes, in ms.
fn median_tail(t: &Timeline) -> Option<f64> {
    let tails: Vec<f64> = t
        .lanes
        .iter()
        .filter_map(|l| l.exposed_tail().map(|d| d.as_nanos() as f64 / 1e6))
        .collect();
    (!tails.is_empty()).then(|| median(tails))
}

/// The last moment drawn in a lane, in ms from its origin.
fn lane_end(l: &Lane) -> f64 {
    let mut end: f64 = 0.0;
    for c in &l.chunks {
        end = end.max(l.ms(c.computed));
        if let Some(b) = c.batch {
            end = end.max(l.ms(b.reported));
        }
    }
    for at in [l.last_computed, l.completed].into_iter().flatten() {
        end = end.max(l.ms(at));
    }
    end
}

fn lane_name(l: &Lane, ranks: bool) -> String {
    if ranks {
        format!("rank {} · req {}", l.rank, l.request.0)
    } else {
        format!("request {}", l.request.0)
    }
}

/// `data` with the layer range an element covers (`data-layer-begin`, `data-layer-end`), when
/// its chunk went out in layer ranges.
fn with_layers(
    mut data: Vec<(&'static str, String)>,
    layers: Option<(u32, u32)>,
) -> Vec<(&'static str, String)> {
    if let Some((b, e)) = layers {
        data.push(("layer-begin", b.to_string()));
        data.push(("layer-end", e.to_string()));
    }
    data
}

/// Draws `panels` under `title` as an SVG document.
pub(crate) fn timeline_svg(
    title: &str,
    panels: &[TimelinePanel<'_>],
) -> Result<String, PictureError> {
    if panels.iter().all(|p| p.timeline.lanes.is_empty()) {
        return Err(PictureError::Empty("the runs have no requests"));
    }
    let heights: Vec<u32> = panels
        .iter()
        .map(|p| panel_height(p.timeline.lanes.len()))
        .collect();
    let height = HEADER + heights.iter().sum::<u32>();
    let end = panels
        .iter()
        .flat_map(|p| p.timeline.lanes.iter().map(lane_end))
        .fold(1.0, f64::max);
    let plot_width = f64::from(WIDTH - LABELS - MARGIN_RIGHT - 10);
    let x_max = end * plot_width / (plot_width - LABEL_ROOM);
    let baseline_tail = panels.first().and_then(|p| median_tail(p.timeline));

    let mut tags = Tags::default();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let (header, mut rest) = root.split_vertically(HEADER);
        draw_header(&header, title, &mut tags)?;
        for (p, h) in panels.iter().zip(&heights) {
            let (area, below) = rest.split_vertically(*h);
            rest = below;
            let ratio = match (median_tail(p.timeline), baseline_tail) {
                (Some(t), Some(b)) if p.name != panels[0].name && b > 0.0 => {
                    format!(", {:.1}× the {}", t / b, panels[0].name)
                }
                _ => String::new(),
            };
            let caption = format!(
                "{}: {} — exposed tail {}{ratio}{}",
                p.name,
                p.description,
                median_tail(p.timeline)
                    .map_or("not reached".into(), |t| format!("{t:.2} ms median")),
                if p.timeline.unpaired_batches > 0 {
                    format!(
                        " ({} write batches not paired with chunks, not drawn)",
                        p.timeline.unpaired_batches
                    )
                } else {
                    String::new()
                }
            );
            draw_panel(&area, &root, p, &caption, x_max, &mut tags)?;
        }
        root.present().map_err(draw_err)?;
    }
    tags.apply(&svg)
}

fn legend_tag(class_of: &str) -> Tag {
    Tag {
        id: format!("legend-{class_of}"),
        class: "legend",
        title: format!("legend: {class_of}"),
        data: Vec::new(),
    }
}

fn draw_header(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    tags: &mut Tags,
) -> Result<(), PictureError> {
    area.draw(&Text::new(
        title.to_string(),
        (16, 12),
        (FONT, 20).into_font().style(FontStyle::Bold).color(&INK),
    ))
    .map_err(draw_err)?;
    let text = |s: &str, x: i32| {
        Text::new(
            s.to_string(),
            (x, 52),
            (FONT, 16)
                .into_font()
                .color(&INK)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        )
    };
    let mut x = 16;
    for (colour, label, class_of) in [
        (COMPUTE, "chunk compute (prefill)", "compute"),
        (TRANSFER, "write batch, issued → reported", "transfer"),
    ] {
        area.draw(&Rectangle::new([(x, 46), (x + 22, 58)], colour.filled()))
            .map_err(draw_err)?;
        tags.push("rect", colour, legend_tag(class_of));
        area.draw(&text(label, x + 28)).map_err(draw_err)?;
        x += 28 + label.len() as i32 * 8 + 26;
    }
    for (colour, label, class_of, vertical) in [
        (LAST_COMPUTED, "last chunk computed", "last-computed", true),
        (COMPLETED, "decode side complete", "completed", true),
        (TAIL, "exposed tail", "tail", false),
    ] {
        let path = if vertical {
            vec![(x + 6, 44), (x + 6, 60)]
        } else {
            vec![(x, 52), (x + 22, 52)]
        };
        area.draw(&PathElement::new(path, colour.stroke_width(3)))
            .map_err(draw_err)?;
        tags.push("polyline", colour, legend_tag(class_of));
        let at = if vertical { x + 14 } else { x + 28 };
        area.draw(&text(label, at)).map_err(draw_err)?;
        x = at + label.len() as i32 * 8 + 26;
    }
    Ok(())
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    panel: &TimelinePanel<'_>,
    caption: &str,
    x_max: f64,
    tags: &mut Tags,
) -> Result<(), PictureError> {
    let lanes = &panel.timeline.lanes;
    let n = lanes.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 18).into_font().color(&INK))
        .margin_left(10)
        .margin_right(MARGIN_RIGHT)
        .margin_top(6)
        .x_label_area_size(42)
        .y_label_area_size(LABELS)
        .build_cartesian_2d(0f64..x_max, 0f64..n)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .y_labels(0)
        .x_labels(12)
        .x_desc("ms since the run began")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .label_style((FONT, 15).into_font().color(&INK))
        .axis_desc_style((FONT, 15).into_font().color(&MUTED))
        .light_line_style(WHITE)
        .bold_line_style(GRID)
        .draw()
        .map_err(draw_err)?;
    // Pixels per ms, to keep short bars visible.
    let (left, _) = chart.backend_coord(&(0.0, 0.0));
    let (right, _) = chart.backend_coord(&(x_max, 0.0));
    let pixel = x_max / f64::from((right - left).max(1));
    // A bar's right end: a pixel short of its end, so that back-to-back chunks stay apart, and
    // never less than a pixel and a half wide.
    let bar_end = |s: f64, e: f64| {
        if e - s > 4.0 * pixel {
            e - pixel
        } else {
            e.max(s + 1.5 * pixel)
        }
    };
    let ranks = lanes.iter().any(|l| l.rank > 0);
    let y = |i: usize, frac: f64| n - i as f64 - frac;
    for (i, lane) in lanes.iter().enumerate() {
        if i % 2 == 1 {
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(0.0, y(i, 0.0)), (x_max, y(i, 1.0))],
                    SHADE.filled(),
                )))
                .map_err(draw_err)?;
        }
        let who = format!("r{}-q{}", lane.rank, lane.request.0);
        let data = |chunk: Option<u32>, start: f64, end: f64| {
            let mut d = vec![
                ("panel", panel.name.to_string()),
                ("rank", lane.rank.to_string()),
                ("request", lane.request.0.to_string()),
            ];
            if let Some(c) = chunk {
                d.push(("chunk", c.to_string()));
            }
            d.push(("start-ms", format!("{start:.3}")));
            d.push(("end-ms", format!("{end:.3}")));
            d
        };
        for c in &lane.chunks {
            // A chunk submitted in layer ranges is one entry per range: each range's compute
            // and write batch are bars of their own, named by their layers.
            let (part, layers) = match c.layers {
                Some((b, e)) => (format!("-l{b}"), format!(", layers {b}–{e}")),
                None => (String::new(), String::new()),
            };
            let (s, e) = (lane.ms(c.compute_started), lane.ms(c.computed));
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [
                        (s, y(i, COMPUTE_ROW.0)),
                        (bar_end(s, e), y(i, COMPUTE_ROW.1)),
                    ],
                    COMPUTE.filled(),
                )))
                .map_err(draw_err)?;
            tags.push(
                "rect",
                COMPUTE,
                Tag {
                    id: format!("{}-{who}-c{}{part}-compute", panel.name, c.index),
                    class: "compute",
                    title: format!(
                        "{} {}, chunk {} (tokens {}–{}{layers}): computed {s:.2} → {e:.2} ms",
                        panel.name,
                        lane_name(lane, true),
                        c.index,
                        c.tokens.0,
                        c.tokens.1
                    ),
                    data: with_layers(data(Some(c.index), s, e), c.layers),
                },
            );
            let Some(b) = c.batch else { continue };
            let (s, e) = (lane.ms(b.issued), lane.ms(b.reported));
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [
                        (s, y(i, TRANSFER_ROW.0)),
                        (bar_end(s, e), y(i, TRANSFER_ROW.1)),
                    ],
                    TRANSFER.filled(),
                )))
                .map_err(draw_err)?;
            tags.push(
                "rect",
                TRANSFER,
                Tag {
                    id: format!("{}-{who}-c{}{part}-transfer", panel.name, c.index),
                    class: "transfer",
                    title: format!(
                        "{} {}, chunk {}{layers}: write batch of {:.1} MiB, issued {s:.2} ms, \
                         reported {e:.2} ms (bytes moved in {:.2} ms)",
                        panel.name,
                        lane_name(lane, true),
                        c.index,
                        b.bytes as f64 / f64::from(1u32 << 20),
                        b.transfer.as_nanos() as f64 / 1e6
                    ),
                    data: with_layers(data(Some(c.index), s, e), c.layers),
                },
            );
        }
        let marks = [
            (
                lane.last_computed,
                LAST_COMPUTED,
                "last-computed",
                "last chunk computed",
            ),
            (
                lane.completed,
                COMPLETED,
                "completed",
                "decode side complete",
            ),
        ];
        for (at, colour, class, what) in marks {
            let Some(at) = at else { continue };
            let t = lane.ms(at);
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(t, y(i, 0.04)), (t, y(i, 0.94))],
                    colour.stroke_width(2),
                )))
                .map_err(draw_err)?;
            tags.push(
                "polyline",
                colour,
                Tag {
                    id: format!("{}-{who}-{class}", panel.name),
                    class,
                    title: format!(
                        "{} {}: {what} at {t:.2} ms",
                        panel.name,
                        lane_name(lane, true)
                    ),
                    data: data(None, t, t),
                },
            );
        }
        if let (Some(from), Some(to)) = (lane.last_computed, lane.completed) {
            let (s, e) = (lane.ms(from), lane.ms(to));
            let tail = e - s;
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(s, y(i, TAIL_ROW)), (e.max(s + pixel), y(i, TAIL_ROW))],
                    TAIL.stroke_width(3),
                )))
                .map_err(draw_err)?;
            tags.push(
                "polyline",
                TAIL,
                Tag {
                    id: format!("{}-{who}-tail", panel.name),
                    class: "tail",
                    title: format!(
                        "{} {}: exposed tail {tail:.2} ms (last chunk computed → decode side \
                         complete)",
                        panel.name,
                        lane_name(lane, true)
                    ),
                    data: data(None, s, e),
                },
            );
            let (px, py) = chart.backend_coord(&(e, y(i, TAIL_ROW)));
            root.draw(&Text::new(
                format!("exposed tail {tail:.1} ms"),
                (px + 8, py),
                (FONT, 17)
                    .into_font()
                    .style(FontStyle::Bold)
                    .color(&TAIL)
                    .pos(Pos::new(HPos::Left, VPos::Center)),
            ))
            .map_err(draw_err)?;
        }
        let (px, py) = chart.backend_coord(&(0.0, y(i, 0.5)));
        root.draw(&Text::new(
            lane_name(lane, ranks),
            (px - 12, py),
            (FONT, 17)
                .into_font()
                .color(&INK)
                .pos(Pos::new(HPos::Right, VPos::Center)),
        ))
        .map_err(draw_err)?;
    }
    Ok(())
}
