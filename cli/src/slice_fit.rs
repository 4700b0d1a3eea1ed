//! How `--layers-per-slice N` fell on a model's layers: what `demo`, `bench pipeline` and
//! `bench fragments` say about the ranges a chunk really went out in.
//!
//! 1. The ranges run from layer 0 to the model's last (per rank), N layers each; the last one
//!    may be shorter.
//! 2. An N of more layers than the model has is one range, the whole chunk: said in words
//!    ([`SliceFit::note`]) and in the JSON (`layers_per_slice_exceeds_model`), never left to
//!    be read as N-layer ranges.

use kvpipe_conformance::suite::demo::DemoConfig;
use kvpipe_conformance::suite::{layer_slices, TransferMode};
use serde::Serialize;

/// The layer ranges of one chunk under `--layers-per-slice N`, as the JSON reports them
/// (flattened beside `layers_per_slice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct SliceFit {
    /// Layers of the last range a chunk goes out in (every earlier range has N).
    pub last_range_layers: u32,
    /// N is more than the model's layers (per rank): each chunk went out whole, in one range.
    pub layers_per_slice_exceeds_model: bool,
    /// N.
    #[serde(skip)]
    per_slice: u16,
    /// The model's layers (per rank): the ranges' layers summed.
    #[serde(skip)]
    model_layers: u32,
}

impl SliceFit {
    /// The fit of N = `per_slice` given the layers of each range a chunk is submitted in, in
    /// order.
    pub(crate) fn of(per_slice: u16, range_layers: impl IntoIterator<Item = u32>) -> Self {
        let (mut last, mut model_layers) = (0, 0);
        for layers in range_layers {
            last = layers;
            model_layers += layers;
        }
        SliceFit {
            last_range_layers: last,
            layers_per_slice_exceeds_model: u32::from(per_slice) > model_layers,
            per_slice,
            model_layers,
        }
    }

    /// The fit of a demo run's layer slices (`None` unless it runs in layer slices): the
    /// ranges as the engine model submits them.
    pub(crate) fn of_demo(config: &DemoConfig) -> Option<Self> {
        let TransferMode::LayerSlices(n) = config.mode else {
            return None;
        };
        let ranges = layer_slices(&config.model.groups(config.window), n);
        Some(SliceFit::of(n, ranges.iter().map(|r| r.len())))
    }

    /// The last range in words: "2 layers", or "32 layers, --layers-per-slice 100 is more than
    /// the model's 32 layers".
    pub(crate) fn note(&self) -> String {
        let layers = self.last_range_layers;
        if self.layers_per_slice_exceeds_model {
            format!(
                "{layers} layers, --layers-per-slice {} is more than the model's {} layers",
                self.per_slice, self.model_layers
            )
        } else {
            format!("{layers} layers")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SliceFit;

    #[test]
    fn the_last_range_is_what_is_left_and_an_n_past_the_model_is_said() {
        assert_eq!(
            SliceFit::of(3, [3; 10].into_iter().chain([2])).note(),
            "2 layers"
        );
        assert_eq!(SliceFit::of(4, [4; 8]).note(), "4 layers");
        let whole = SliceFit::of(100, [32]);
        assert!(whole.layers_per_slice_exceeds_model);
        assert_eq!(
            whole.note(),
            "32 layers, --layers-per-slice 100 is more than the model's 32 layers"
        );
        assert!(!SliceFit::of(32, [32]).layers_per_slice_exceeds_model);
    }
}
