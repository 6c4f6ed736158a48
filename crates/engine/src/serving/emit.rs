//! The output stage of a serving step: every event a client receives while its request runs is
//! sent from here. Before the forward pass, [`started`] tells the newly admitted requests'
//! clients; after `Scheduler::update`, [`emit`] sends the embeddings, the prompt
//! log-probabilities and each token's text (through the request's output processor, which
//! finds stop strings), and lists the requests that end and why. A client found gone ends its
//! request by abort.

use crate::sched::{Outcome, SchedulerOutput};
use crate::serving::execute::ModelOutput;
use crate::serving::live::Requests;
use crate::serving::shared::Shared;
use crate::types::{Event, FinishReason};

/// The step's admissions: the counters, and each new request's `Started` (a client found gone
/// joins `reqs.dead`).
pub(crate) fn started(sh: &Shared, out: &SchedulerOutput, reqs: &mut Requests) {
    let first = || out.started.iter().filter(|s| !s.resumed);
    {
        let mut st = sh.stats_mut();
        st.steps_total += 1;
        st.preemptions_total += out.preempted.len() as u64;
        for s in first() {
            st.prefix_cache_hit_tokens_total += s.cached_tokens as u64;
            st.prompt_tokens_total += s.prompt_tokens as u64;
        }
    }
    for s in first() {
        let Some(l) = reqs.live.get_mut(&s.id) else {
            continue;
        };
        l.counts.prompt_tokens = s.prompt_tokens;
        l.counts.cached_tokens = s.cached_tokens;
        if !l.send(Event::Started {
            prompt_tokens: s.prompt_tokens,
            cached_tokens: s.cached_tokens,
        }) {
            reqs.dead.push(s.id);
        }
    }
}

/// The step's results to the clients: `outcomes` are `Scheduler::update`'s for `mo.sampled`.
/// The requests that end, and why, go to `ended` (their `Finished` is the caller's to send,
/// once the scheduler has let them go).
pub(crate) fn emit(
    sh: &Shared,
    outcomes: &[Outcome],
    mo: &mut ModelOutput,
    reqs: &mut Requests,
    ended: &mut Vec<(u64, FinishReason)>,
) {
    ended.clear();
    embeddings(mo, reqs);
    prompt_logprobs(mo, reqs);
    let generated = tokens(outcomes, mo, reqs, ended);
    sh.stats_mut().generated_tokens_total += generated;
    ended.extend(reqs.dead.iter().map(|&id| (id, FinishReason::Abort)));
    let embedded = mo.embeddings.iter().filter(|e| !reqs.dead.contains(&e.0));
    ended.extend(embedded.map(|e| (e.0, FinishReason::Stop)));
}

/// The embedding requests' vectors (each request then ends).
fn embeddings(mo: &mut ModelOutput, reqs: &mut Requests) {
    for (id, v) in mo.embeddings.iter_mut() {
        let sent = reqs
            .live
            .get_mut(id)
            .is_some_and(|l| l.send(Event::Embedding(std::mem::take(v))));
        if !sent && !reqs.dead.contains(id) {
            reqs.dead.push(*id);
        }
    }
}

/// The prompt log-probabilities, with the request's first sampling row (before its token).
fn prompt_logprobs(mo: &ModelOutput, reqs: &mut Requests) {
    for &(id, _) in &mo.rows {
        let Some(l) = reqs.live.get_mut(&id) else {
            continue;
        };
        if l.prompt_logprobs.take().is_some() {
            let all = std::mem::take(&mut l.prompt_lps);
            if !l.send(Event::PromptLogprobs(all.into_iter().flatten().collect()))
                && !reqs.dead.contains(&id)
            {
                reqs.dead.push(id);
            }
        }
    }
}

/// Each token taken, as text through the request's output processor; the requests that end
/// with it go to `ended`. Returns the number of tokens generated.
fn tokens(
    outcomes: &[Outcome],
    mo: &mut ModelOutput,
    reqs: &mut Requests,
    ended: &mut Vec<(u64, FinishReason)>,
) -> u64 {
    let mut generated = 0;
    for o in outcomes {
        // A request that ended on an earlier token of this step (a stop string) takes no more.
        let Some(l) = reqs
            .live
            .get_mut(&o.id)
            .filter(|_| !reqs.dead.contains(&o.id) && !ended.iter().any(|e| e.0 == o.id))
        else {
            continue;
        };
        let lp = &mut mo.logprobs[o.index];
        if !o.appended {
            // An end-of-generation token: the scheduler ended the request without it.
            ended.push((o.id, FinishReason::Stop));
            continue;
        }
        generated += 1;
        l.counts.completion_tokens += 1;
        let emit = l.out.push(o.token);
        let mut text = emit.text;
        let grammar_done = l.constraint.as_ref().is_some_and(|c| c.done());
        let reason = finish_reason(o.finish, emit.stop, grammar_done);
        if reason.is_some() && !emit.stop {
            // The text held back for a stop string that did not come.
            text.push_str(&l.out.finish());
        }
        let alive = l.send(Event::Token {
            id: o.token,
            text,
            logprob: lp.take(),
        });
        match (alive, reason) {
            (false, _) => ended.push((o.id, FinishReason::Abort)),
            (true, Some(r)) => ended.push((o.id, r)),
            (true, None) => {}
        }
    }
    generated
}

/// Why a request ends with the token it just took, if it does: a stop string in its text
/// (`stop_string`), else the scheduler's reason (the token limit; an end-of-generation token
/// is never taken), else the end of its grammar.
fn finish_reason(
    sched: Option<FinishReason>,
    stop_string: bool,
    grammar_done: bool,
) -> Option<FinishReason> {
    if stop_string {
        Some(FinishReason::Stop)
    } else {
        sched.or(grammar_done.then_some(FinishReason::Stop))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use FinishReason::*;

    #[test]
    fn a_stop_string_then_the_scheduler_then_the_grammar_end_a_request() {
        // (scheduler's reason, stop string found, grammar done) → the request's end.
        let cases = [
            (None, false, false, None),
            (None, true, false, Some(Stop)),
            (None, false, true, Some(Stop)),
            (Some(Length), false, false, Some(Length)),
            // A stop string in the last token's text: the text ends before it, so Stop.
            (Some(Length), true, false, Some(Stop)),
            // The grammar ends on the last allowed token: the limit is what stopped it.
            (Some(Length), false, true, Some(Length)),
            (Some(Length), true, true, Some(Stop)),
        ];
        for (sched, stop, grammar, want) in cases {
            assert_eq!(
                finish_reason(sched, stop, grammar),
                want,
                "{sched:?} {stop} {grammar}"
            );
        }
    }
}
