//! A Python block source: a callable, or the request's block tables.

use kvpipe_core::{BlockId, BlockRun, BlockSource, BlockSourceError, GroupIndex, RequestId};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// What `Sender.submit_chunk`'s `blocks` answers the core's queries with.
///
/// - A callable `blocks(request, group, begin, end) -> (first_ordinal, ids)`: the contiguous
///   run of resident blocks ending at `end` (the core's `BlockSource` contract).
/// - A sequence of per-group block tables: entry `o` of table `g` is the slot of block ordinal
///   `o` of group `g`, or a negative number / None when that block is not resident. Only
///   `table[begin:end]` is read for a query.
///
/// The GIL is taken only while Python answers, with the node locked: the callable must not call
/// into the same node. An exception raised by the callable is kept and raised by the submit
/// call.
pub(crate) struct PySource {
    blocks: Py<PyAny>,
    callable: bool,
    pub(crate) error: Option<PyErr>,
}

impl PySource {
    pub(crate) fn new(blocks: &Bound<'_, PyAny>) -> Self {
        PySource {
            blocks: blocks.clone().unbind(),
            callable: blocks.is_callable(),
            error: None,
        }
    }

    fn answer(
        &self,
        py: Python<'_>,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> PyResult<Result<(), BlockSourceError>> {
        let blocks = self.blocks.bind(py);
        out.ids.clear();
        if self.callable {
            let answer = blocks.call1((request.0, group.0, begin, end))?;
            let (first, ids) = crate::arguments::block_run(
                &answer,
                "a block source's answer",
                "a block source returns (first_ordinal, ids): the run of resident blocks ending \
                 at `end`",
            )?;
            out.first_ordinal = first;
            out.ids = ids;
            return Ok(Ok(()));
        }
        let groups = blocks.len()?;
        if usize::from(group.0) >= groups {
            return Ok(Err(BlockSourceError::UnknownGroup(group)));
        }
        let table = blocks.get_item(group.0)?;
        let allocated = u32::try_from(table.len()?).unwrap_or(u32::MAX);
        if begin > end {
            return Ok(Err(BlockSourceError::BeginAfterEnd { begin, end }));
        }
        if end > allocated {
            return Ok(Err(BlockSourceError::PastAllocation { end, allocated }));
        }
        // The resident run ending at `end`: walk back from `end - 1` to the last gap.
        let mut first = end;
        while first > begin {
            let entry = table.get_item(first - 1)?;
            let slot: Option<i64> = entry.extract()?;
            match slot {
                Some(s) if s >= 0 => {
                    let s = u32::try_from(s).map_err(|_| {
                        PyValueError::new_err(format!("block slot {s} does not fit 32 bits"))
                    })?;
                    out.ids.push(BlockId(s));
                    first -= 1;
                }
                _ => break,
            }
        }
        out.ids.reverse();
        out.first_ordinal = first;
        Ok(Ok(()))
    }
}

impl BlockSource for PySource {
    fn block_run(
        &mut self,
        request: RequestId,
        group: GroupIndex,
        begin: u32,
        end: u32,
        out: &mut BlockRun,
    ) -> Result<(), BlockSourceError> {
        let answered = Python::attach(|py| self.answer(py, request, group, begin, end, out));
        match answered {
            Ok(result) => result,
            Err(e) => {
                self.error = Some(e);
                // Any error stops the chunk with the state unchanged; the Python exception is
                // what the caller sees.
                Err(BlockSourceError::UnknownRequest(request))
            }
        }
    }
}
