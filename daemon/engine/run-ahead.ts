/**
 * The main thread's side of the worker's run-ahead. A decode step hands the worker the draws of
 * its next few steps (`ahead` picks); the worker feeds back each token it picks at once instead of
 * waiting for the main thread's next step, and posts the tokens in 'ahead' messages
 * (reproduction/results/engine.md, "The worker runs decode steps ahead": the worker's idle wait
 * for the main thread's next step was the decode loop's cost). This
 * tracker holds, per sequence, what the worker computed ahead, and decides whether a step the
 * caller asks for is the one the worker already ran.
 *
 * Invariants:
 * - A token computed ahead is taken only by the step that feeds the same token at the same
 *   position (the next one the caller has not fed, within the picks the worker holds). Anything
 *   else (another token, position or shape, a free, retain, rollback or plain step) drops the
 *   sequence's state here, and the step goes to the worker as a new one.
 * - The worker rolls back what it ran ahead before it runs any other step of that sequence, so
 *   dropping the state here is all the main thread does.
 * - Positions computed ahead but never taken are not the sequence's: retain keeps at most those
 *   fed (drop returns that bound).
 * No I/O of its own: picks for the worker go through `post`, batched once per microtask turn.
 */
import { deserializeError } from '../errors.ts'
import { codedAbortReason, firstAborted } from '../abort.ts'
import { stepMark } from '../step-trace.ts'
import { AbortedError, EngineError } from './errors.ts'
import type { FromWorker, StepOutput, WorkerTurn } from './protocol.ts'
import type { TokenPick } from './sampling.ts'

/** The fields of a batch step the tracker reads (StageBatchItem in stage-engine.ts). */
export interface RunAheadItem {
  seqId: string
  input: { tokenIds: number[] } | { hidden: Float32Array }
  positions: number[]
  pick?: TokenPick
  ahead?: TokenPick[]
  /** A greedy verify (protocol.ts BatchStepItem.verify): it runs ahead from its first position's successor, and only when its verdict accepts nothing. */
  verify?: 'greedy'
}

/** One ahead-picks entry: `picks[0]` is for the step that feeds position `from`. */
export interface MorePicks { seqId: string, from: number, picks: TokenPick[] }

/** A step taken from the run-ahead: the worker's token (and the turn that computed it), or the error that ended the sequence. */
export type TakenStep = { output: StepOutput, ranAhead: true, run?: WorkerTurn } | { error: Error }

export interface RunAheadTracker {
  /** Whether `seqId` is running ahead (its next step may be taken rather than run). */
  has (seqId: string): boolean
  /**
   * A step going to the worker: drops the sequence's old state and, when `item` runs ahead,
   * starts a new one. The picks the worker may run (the context end bounds them), else undefined.
   */
  start (item: RunAheadItem): TokenPick[] | undefined
  /**
   * The token computed ahead for `item`, waiting for the worker when it is still running it;
   * undefined when this item is not the continuation the worker runs (it then goes as a new step).
   * The wait ends when any of `signals` aborts (the batch's and the request's: not composed, see
   * stage-engine's stepBatch).
   */
  take (item: RunAheadItem, signals: readonly AbortSignal[]): Promise<TakenStep | undefined>
  /** After a take: hands the worker the picks of `item.ahead` it does not have yet (at most to the context end). */
  extend (item: RunAheadItem): void
  /** The worker's 'ahead' message: tokens computed ahead, or the errors that ended sequences. */
  onAhead (msg: Extract<FromWorker, { type: 'ahead' }>): void
  /** Ends `seqId`'s run-ahead state; the positions it had fed (what retain may keep), undefined when none. */
  drop (seqId: string): number | undefined
  /** The worker is gone: callers waiting for a step it was running ahead fail with `err`. */
  failAll (err: Error): void
}

/**
 * Turns shorter than this hold their run-ahead tokens for one more turn (aheadPostDue).
 * Why: each 'ahead' message wakes the main thread, and waking a sleeping thread costs the thread
 * that posts it 20–50 µs on the 2-core VMs measured (docs/engine-notes.md, wave 21) — paid by the
 * engine worker between two runs, 3 % of a 1.5 ms one-row step. Below 2 ms a step, posting every
 * other turn halves that; above it the wake-up is at most ~2.5 % of a step and tokens go at once.
 */
export const AHEAD_HOLD_MS = 2

/**
 * Whether the worker posts the run-ahead tokens it holds now (else it holds them over its next
 * turn). `turnMs`: the turn just run; `heldTurns`: the turns whose tokens are held, that one
 * included; `waiting`: some sequence can take no further step without the main thread (its picks
 * ran out, or a step of it failed). A token is held at most one turn, and only after a short one.
 */
export function aheadPostDue ({ turnMs, heldTurns, waiting }: { turnMs: number, heldTurns: number, waiting: boolean }): boolean {
  return waiting || heldTurns >= 2 || !(turnMs < AHEAD_HOLD_MS)
}

/**
 * Whether the worker runs a greedy verify's sequence ahead after it (given `ahead` picks): only
 * when no draft stood, the step then yielding one token as a decode step does. Drafts that stood
 * are text repeating, and the speculative source verifies again next rather than stepping plainly
 * (its pause after a round that stood): picks held by a run-ahead would hold that round back until
 * they drained. Both threads decide by this, so the main thread knows without asking.
 */
export function runsAheadAfter (accepted: number): boolean {
  return accepted === 0
}

export interface RunAheadOptions {
  /** The stage's context length: no pick is handed the worker for a position at or past it. */
  maxPositions: number
  /** Sends an ahead-picks message (one per microtask turn; never with no items). */
  post: (items: MorePicks[]) => void
}

/** Main-thread view of a sequence running ahead in the worker. */
interface Ahead {
  /** Tokens computed ahead by the position they were fed at. */
  tokens: Map<number, { fed: number, token: number, turn: WorkerTurn | undefined }>
  /** The highest position the worker has a pick for (it will compute up to it unless ended). */
  pickedTo: number
  /** Positions the caller has fed (taken results included): what retain may keep. */
  fedTo: number
  /** The worker's error for a step run ahead: the sequence is over. */
  failed: Error | undefined
  /** Wakes a caller waiting for a position. */
  wake: (() => void) | undefined
}

export function createRunAheadTracker ({ maxPositions, post }: RunAheadOptions): RunAheadTracker {
  const aheads = new Map<string, Ahead>()

  /** Picks to hand the worker, sent together once the current microtasks are done (one message per wake-up). */
  let morePicks: MorePicks[] = []
  const flushPicks = (): void => {
    const items = morePicks
    morePicks = []
    if (items.length > 0) post(items)
  }

  return {
    has: seqId => aheads.has(seqId),
    start (item) {
      aheads.delete(item.seqId)
      if (item.ahead === undefined || (item.pick === undefined && item.verify === undefined) || item.positions.length === 0 || !('tokenIds' in item.input)) return undefined
      // A decode step's one position, or a prefill's last: the worker's first step ahead feeds the
      // next. A verify's first: it runs ahead only where no draft stood (runsAheadAfter; the
      // caller drops the state on any other verdict).
      const position = item.verify === undefined ? item.positions[item.positions.length - 1]! : item.positions[0]!
      const picks = item.ahead.slice(0, Math.max(0, maxPositions - position - 1))
      if (picks.length === 0) return undefined
      aheads.set(item.seqId, { tokens: new Map(), pickedTo: position + picks.length, fedTo: position + 1, failed: undefined, wake: undefined })
      return picks
    },
    async take (item, signals) {
      const a = aheads.get(item.seqId)
      if (a === undefined || item.pick === undefined || !('tokenIds' in item.input) || item.positions.length !== 1) return undefined
      const position = item.positions[0]!
      const fed = item.input.tokenIds[0]!
      if (position !== a.fedTo || position > a.pickedTo) { aheads.delete(item.seqId); return undefined }
      for (;;) {
        const got = a.tokens.get(position)
        if (got !== undefined) {
          if (got.fed !== fed) { aheads.delete(item.seqId); return undefined } // not the same step: a new one
          a.tokens.delete(position)
          a.fedTo = position + 1
          stepMark('e.took')
          return { output: { kind: 'token', id: got.token }, ranAhead: true, ...(got.turn === undefined ? {} : { run: got.turn }) }
        }
        if (a.failed !== undefined) { aheads.delete(item.seqId); return { error: a.failed } }
        if (aheads.get(item.seqId) !== a) return { error: new EngineError(`sequence ${item.seqId} ended while a step ran ahead`) }
        const aborted = firstAborted(signals)
        if (aborted !== undefined) return { error: codedAbortReason(aborted, () => new AbortedError()) }
        stepMark('e.wait')
        await new Promise<void>(resolve => {
          const done = (): void => { a.wake = undefined; for (const s of signals) s.removeEventListener('abort', done); resolve() }
          a.wake = done
          for (const s of signals) s.addEventListener('abort', done, { once: true })
        })
      }
    },
    extend (item) {
      const a = aheads.get(item.seqId)
      if (a === undefined || item.ahead === undefined) return
      const next = item.positions[0]! + 1
      const fresh: TokenPick[] = []
      item.ahead.forEach((pick, i) => { const p = next + i; if (p > a.pickedTo && p < maxPositions) fresh.push(pick) })
      if (fresh.length === 0) return
      if (morePicks.length === 0) queueMicrotask(flushPicks)
      morePicks.push({ seqId: item.seqId, from: a.pickedTo + 1, picks: fresh })
      a.pickedTo += fresh.length
    },
    onAhead (msg) {
      for (const r of msg.results) {
        const a = aheads.get(r.seqId)
        if (a === undefined) continue // ended here meanwhile
        if ('error' in r) a.failed ??= deserializeError(r.error)
        else a.tokens.set(r.position, { fed: r.fed, token: r.token, turn: r.turn })
        a.wake?.()
      }
    },
    drop (seqId) {
      const a = aheads.get(seqId)
      aheads.delete(seqId)
      return a?.fedTo
    },
    failAll (err) {
      for (const a of aheads.values()) { a.failed ??= err; a.wake?.() }
      aheads.clear()
    },
  }
}
