//! An endpoint's recorded inputs are its whole story: replayed into a fresh endpoint after a
//! faulty simulated run, they give exactly the outputs the original endpoint gave.

use kvpipe_core::session::{Output, Receiver, Sender, SenderInput, TransportInput};
use kvpipe_sim::{FaultSet, SimConfig, Simulation};

fn replay_sender(sim: &mut Simulation, rank: usize) -> (usize, Vec<Output>, Vec<Output>) {
    let inputs = sim.sender_mut(rank).take_recorded_inputs();
    // The faults reached this endpoint as inputs.
    assert!(inputs.iter().any(|i| matches!(
        i,
        SenderInput::Transport {
            input: TransportInput::WritesFailed { .. } | TransportInput::PeerDisconnected { .. },
            ..
        }
    )));
    let mut fresh = Sender::new(sim.sender(rank).config().clone()).unwrap();
    let mut outputs = Vec::new();
    for input in &inputs {
        fresh
            .handle_input(input.clone())
            .unwrap_or_else(|e| panic!("the replay refused {input:?}: {e}"));
        outputs.extend(std::iter::from_fn(|| fresh.poll_output()));
    }
    (inputs.len(), outputs, sim.take_outputs(Some(rank)))
}

fn replay_receiver(sim: &mut Simulation) -> (usize, Vec<Output>, Vec<Output>) {
    let inputs = sim.receiver_mut().take_recorded_inputs();
    let mut fresh = Receiver::new(sim.receiver().config().clone()).unwrap();
    let mut outputs = Vec::new();
    for input in &inputs {
        fresh
            .handle_input(input.clone())
            .unwrap_or_else(|e| panic!("the replay refused {input:?}: {e}"));
        outputs.extend(std::iter::from_fn(|| fresh.poll_output()));
    }
    (inputs.len(), outputs, sim.take_outputs(None))
}

#[test]
fn sim_replay_of_recorded_inputs_gives_the_same_outputs() {
    for seed in [3, 8] {
        let mut sim = Simulation::random(SimConfig::new(seed, FaultSet::all()), 120);
        sim.record(true);
        let report = sim.run();
        assert!(!report.has_bugs(), "{report:?}");
        // The run was faulty: some requests failed, some completed.
        assert!(report.failed > 0 && report.completed > 0, "{report:?}");
        for rank in 0..2 {
            let (inputs, replayed, original) = replay_sender(&mut sim, rank);
            assert!(
                inputs > 100 && original.len() > 100,
                "{inputs} {}",
                original.len()
            );
            assert!(
                replayed == original,
                "seed {seed}: sender rank {rank}'s replay differs from output {}",
                first_difference(&replayed, &original)
            );
        }
        let (inputs, replayed, original) = replay_receiver(&mut sim);
        assert!(
            inputs > 100 && original.len() > 100,
            "{inputs} {}",
            original.len()
        );
        assert!(
            replayed == original,
            "seed {seed}: the receiver's replay differs from output {}",
            first_difference(&replayed, &original)
        );
    }
}

fn first_difference(a: &[Output], b: &[Output]) -> String {
    let k = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    format!(
        "{k} of {}/{}: {:?} vs {:?}",
        a.len(),
        b.len(),
        a.get(k),
        b.get(k)
    )
}
