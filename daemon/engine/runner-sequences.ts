/**
 * What the dynamic and the static stage runner do alike with their sequences, whatever their KV
 * looks like: check a step's inputs against the stage, mark a sequence running for one step at a
 * time and end it when a step fails, sort a batch's items into runnable and refused ones, drop
 * one and say why its step ended, and check a rollback.
 */
import { AbortedError, EngineError } from './errors.ts'
import type { BatchStepItem, StageInfo, StepInput, StepOutput } from './protocol.ts'
import type { TokenPick } from './sampling.ts'

/** The part of a runner's sequence these helpers read and write. */
export interface RunnerSequence {
  length: number
  running: Promise<void> | undefined
  dropped: 'free' | 'cancel' | undefined
}

/** A step's outcome within a batch: its output, or the error of that item alone. */
export type BatchStepResult = { output: StepOutput } | { error: Error }

/** Throws what is wrong with a step's inputs on this stage (the context limit is the runner's own check). */
export function checkStepInput (stage: Pick<StageInfo, 'hasHead' | 'hasEmbedding' | 'hiddenSize'>, input: StepInput, positions: BigInt64Array, pick: TokenPick | undefined): void {
  const s = positions.length
  if (pick !== undefined && !stage.hasHead) throw new EngineError('only the last stage (with the LM head) can pick tokens')
  const given = input.kind === 'tokens' ? input.ids.length : input.data.length / stage.hiddenSize
  if (input.kind === 'tokens' && !stage.hasEmbedding) throw new EngineError('this stage takes hidden states, not token ids')
  if (input.kind === 'hidden' && stage.hasEmbedding) throw new EngineError('this stage takes token ids, not hidden states')
  if (s === 0 || given !== s) throw new EngineError(`step has ${given} inputs for ${s} positions`)
}

/**
 * Runs `work` as the sequence's one running step. A failed step leaves the cache in an unknown
 * state: the sequence is over (removed from `sequences`).
 */
export async function guardStep<S extends RunnerSequence> (sequences: Map<string, S>, seqId: string, seq: S, work: () => Promise<StepOutput>): Promise<StepOutput> {
  const result = work()
  seq.running = result.then(() => {}, () => {})
  try {
    return await result
  } catch (err) {
    if (sequences.get(seqId) === seq) sequences.delete(seqId)
    throw err
  } finally {
    seq.running = undefined
  }
}

/** One step of one open sequence that has no step running. */
export async function stepSequence<S extends RunnerSequence> (sequences: Map<string, S>, seqId: string, run: (seq: S) => Promise<StepOutput>): Promise<StepOutput> {
  const seq = sequences.get(seqId)
  if (seq === undefined) throw new EngineError(`unknown sequence ${seqId}`)
  if (seq.running !== undefined) throw new EngineError(`sequence ${seqId} already has a step running`)
  return await guardStep(sequences, seqId, seq, async () => await run(seq))
}

/**
 * A batch's items that may run (open, no step running, named once), in order; the others get
 * their error in `results` at their index.
 */
export function takeBatch<S extends RunnerSequence> (sequences: Map<string, S>, items: BatchStepItem[]): {
  results: BatchStepResult[]
  live: Array<{ index: number, seqId: string, seq: S, item: BatchStepItem }>
} {
  const results: BatchStepResult[] = new Array(items.length)
  const live: Array<{ index: number, seqId: string, seq: S, item: BatchStepItem }> = []
  const taken = new Set<string>()
  items.forEach((item, index) => {
    const seq = sequences.get(item.seqId)
    if (seq === undefined) results[index] = { error: new EngineError(`unknown sequence ${item.seqId}`) }
    else if (seq.running !== undefined || taken.has(item.seqId)) results[index] = { error: new EngineError(`sequence ${item.seqId} already has a step running`) }
    else { taken.add(item.seqId); live.push({ index, seqId: item.seqId, seq, item }) }
  })
  return { results, live }
}

/**
 * Ends a sequence (freed or cancelled): a step still running stops at its next run boundary and
 * fails with `droppedError`; `clear` lets go of its KV. Resolves once that step is over.
 */
export async function dropSequence<S extends RunnerSequence> (sequences: Map<string, S>, seqId: string, how: 'free' | 'cancel', clear: (seq: S) => void): Promise<void> {
  const seq = sequences.get(seqId)
  if (seq === undefined) return
  seq.dropped = how
  sequences.delete(seqId)
  clear(seq)
  await seq.running
}

/** Why a step of a sequence dropped under it ended: cancelled, or freed. */
export function droppedError (seqId: string, seq: Pick<RunnerSequence, 'dropped'>): Error {
  return seq.dropped === 'cancel' ? new AbortedError() : new EngineError(`sequence ${seqId} was freed during a step`)
}

/** The sequence a rollback to `length` applies to, or the error saying why it cannot (both runners). */
export function rollbackTarget<S extends Pick<RunnerSequence, 'running' | 'length'>> (seq: S | undefined, seqId: string, length: number): S {
  if (seq === undefined) throw new EngineError(`unknown sequence ${seqId}`)
  if (seq.running !== undefined) throw new EngineError(`sequence ${seqId} has a step running; it cannot be rolled back now`)
  if (!Number.isSafeInteger(length) || length < 0 || length > seq.length) throw new EngineError(`sequence ${seqId} holds ${seq.length} positions; cannot roll back to ${length}`)
  return seq
}
