//! The engines' mistakes: the prefill engines' (the `engine` fault: a chunk handed to the
//! sender with a bent block run or a changed prefix, which the sender must refuse or the
//! receiver's share check must catch) and the decode engine's (the `decode` fault: a
//! registration with the wrong writers or too few blocks, which the receiver must refuse or
//! fail once the writers' cover is known).

use kvpipe_core::{BlockId, BlockRun, BlockSource, BlockSourceError, GroupIndex, RequestId};

use smallvec::SmallVec;

use crate::SimRng;

/// A mistake of the prefill engine in the chunk it hands the sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineMistake {
    /// One block more than asked.
    TooLong,
    /// The run's first block dropped (allowed only in a windowed group, where the receiver's
    /// share check catches it).
    DropHead,
    /// The run starts one ordinal late, so it ends past the asked end.
    Shifted,
    /// The run's last block dropped, so it ends early.
    EndsEarly,
    /// A later chunk claims another cached prefix.
    PrefixChanged,
}

/// A mistake of the decode engine in the registration it hands the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DecodeMistake {
    /// One of the request's writer ranks left out (only when it has two or more).
    DropWriter,
    /// A sender rank that is not a writer of the request listed too: under the simulated
    /// splits it holds the same part as a writer (two writers claiming one part).
    ExtraWriter,
    /// The first non-empty group's last block left out: the registration ends before the
    /// prompt's last block.
    Truncated,
}

/// Where the engines' mistakes are drawn from: generators of their own and rates.
#[derive(Debug)]
pub(crate) struct Mistakes {
    /// A stream apart from the engines' other choices, so a change of fault rates does not
    /// move them.
    rng: SimRng,
    /// Probability that a writer's chunk carries a mistake (0 unless the `engine` fault is on).
    rate: f64,
    /// The decode engine's stream, apart from the prefill engines' mistakes.
    decode_rng: SimRng,
    /// Probability that a registration carries a mistake (0 unless the `decode` fault is on).
    decode_rate: f64,
}

impl Mistakes {
    pub(crate) fn new(rng: SimRng, rate: f64, decode_rng: SimRng, decode_rate: f64) -> Self {
        Mistakes {
            rng,
            rate,
            decode_rng,
            decode_rate,
        }
    }

    /// Whether a registration carries a mistake, and which: `writers` the request has,
    /// `spare` sender ranks that are not among them.
    pub(crate) fn draw_decode(&mut self, writers: usize, spare: usize) -> Option<DecodeMistake> {
        if self.decode_rate == 0.0 || !self.decode_rng.chance(self.decode_rate) {
            return None;
        }
        let mut kinds: SmallVec<[DecodeMistake; 3]> = SmallVec::new();
        kinds.push(DecodeMistake::Truncated);
        if writers >= 2 {
            kinds.push(DecodeMistake::DropWriter);
        }
        if spare >= 1 {
            kinds.push(DecodeMistake::ExtraWriter);
        }
        self.decode_rng.pick(&kinds).copied()
    }

    /// Whether a writer's chunk `k` carries a mistake, and which.
    pub(crate) fn draw(&mut self, k: usize) -> Option<EngineMistake> {
        if self.rate == 0.0 || !self.rng.chance(self.rate) {
            return None;
        }
        let kinds: &[EngineMistake] = if k == 0 {
            &[
                EngineMistake::TooLong,
                EngineMistake::DropHead,
                EngineMistake::Shifted,
                EngineMistake::EndsEarly,
            ]
        } else {
            &[
                EngineMistake::TooLong,
                EngineMistake::DropHead,
                EngineMistake::Shifted,
                EngineMistake::EndsEarly,
                EngineMistake::PrefixChanged,
            ]
        };
        self.rng.pick(kinds).copied()
    }
}

/// A block source that bends the cache's first non-empty run by `mistake`.
pub(crate) struct Mistaken<'a, S> {
    pub(crate) cache: &'a mut S,
    pub(crate) mistake: EngineMistake,
    /// Whether a run was bent (an empty run has nothing to bend).
    pub(crate) bent: bool,
}

impl<S: BlockSource> BlockSource for Mistaken<'_, S> {
    fn block_run(
        &mut self,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        self.cache.block_run(request, group, begin, end, out)?;
        if self.bent || out.ids.is_empty() {
            return Ok(());
        }
        match self.mistake {
            EngineMistake::TooLong => out.ids.push(BlockId(u32::MAX - 1)),
            EngineMistake::DropHead => {
                out.ids.remove(0);
                out.first_ordinal += 1;
            }
            EngineMistake::Shifted => out.first_ordinal += 1,
            EngineMistake::EndsEarly => {
                out.ids.pop();
            }
            EngineMistake::PrefixChanged => return Ok(()),
        }
        self.bent = true;
        Ok(())
    }
}
