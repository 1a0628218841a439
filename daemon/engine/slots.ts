/**
 * A service's sequence slots: a request takes one now, waits for one while admission.ts's
 * expected wait is within the budget, or is refused with a retry estimate. The whole-model local
 * service and the expert-parallel stage (daemon/experts) admit requests the same way, so that a
 * client sees one policy whatever serves the model.
 *
 * A request holds its slot from `acquire` until `release`; a finished request hands its slot
 * straight to the first waiter. Holding a slot and counting in the running set happen together,
 * synchronously, so concurrent arrivals see each other.
 */
import { abortReason } from './stage-engine.ts'
import { decideAdmission, slotRefusalHint } from './admission.ts'
import type { AdmissionPolicy, SlotPromise, SlotState } from './admission.ts'

/** What a request may still generate (its admission's upper bound); the caller lowers `left` as it goes. */
export interface SlotProgress { left: number }

export interface Slots {
  /**
   * Takes a slot for `progress`, waiting within the budget (`budgetMs`: this request's own, e.g. a
   * sole server's wait until its deadline; the service's by default); throws `refused(…)` or the
   * abort reason.
   */
  acquire (progress: SlotProgress, signal: AbortSignal, budgetMs?: number): Promise<void>
  /** Gives `progress`'s slot to the first waiter (or frees it); nothing when it holds none. */
  release (progress: SlotProgress): void
  /** Fails every waiting request with `err` (the service stops). */
  failWaiting (err: Error): void
  /** Requests holding a slot. */
  readonly active: number
  /** Requests waiting for one. */
  readonly waiting: number
  state (): SlotState
}

export interface SlotsInit extends AdmissionPolicy {
  slots: number
  /** ms of one decode step with every slot busy (0 until measured). */
  stepMs: () => number
  /** The error a refused request gets. */
  refused: (reason: string, retryAfterMs: number) => Error
  /** Clock (ms) for the turns promised to refused requests; performance.now by default. */
  now?: () => number
}

export function createSlots (init: SlotsInit): Slots {
  const running = new Set<SlotProgress>()
  /** Requests waiting for a slot, in arrival order. */
  const waiters: Array<Turn & { tokens: number }> = []
  const now = init.now ?? (() => performance.now())
  /** Refused requests not yet due back (admission.ts `slotRefusalHint`), bounded by maxWaiting. */
  let promised: SlotPromise[] = []
  const state = (): SlotState => ({
    slots: init.slots,
    running: [...running].map(r => r.left),
    waiting: waiters.map(w => w.tokens),
    stepMs: init.stepMs(),
  })
  return {
    async acquire (progress, signal, budgetMs) {
      const s = state()
      const policy = budgetMs === undefined ? init : { ...init, budgetMs }
      const d = decideAdmission(s, policy)
      if (d.kind === 'run') {
        running.add(progress)
        return
      }
      if (d.kind === 'refuse') {
        // Told only when its own wait fits, a refused burst beyond the free slots would come back
        // together and refuse itself again: each is told its turn behind those refused before it.
        const t = now()
        const hint = slotRefusalHint(s, policy, d, promised, t, progress.left)
        promised = [...promised.filter(p => p.returnAt > t), hint.promise].slice(-Math.max(1, init.maxWaiting))
        throw init.refused(d.reason, hint.retryAfterMs)
      }
      // The slot passes straight from the finished request to this one.
      await waitTurn(waiters, { tokens: progress.left }, signal, () => { running.add(progress) })
    },
    release (progress) {
      if (!running.delete(progress)) return
      waiters.shift()?.grant()
    },
    failWaiting (err) {
      for (const w of waiters.splice(0)) w.fail(err)
    },
    get active () { return running.size },
    get waiting () { return waiters.length },
    state,
  }
}

/** A place in a wait queue: `grant` or `fail` settles its wait, once. */
export interface Turn {
  grant: () => void
  fail: (err: Error) => void
}

/**
 * Waits in `queue` (arrival order; the caller shifts and grants) for a turn: resolves once granted
 * (`onGrant` runs synchronously with the grant, so what the turn hands over is taken at once),
 * rejects with `fail`'s error, or with the abort reason when `signal` aborts first (the place is
 * then left). `fields` are kept beside the place (e.g. what the waiter may generate).
 */
export async function waitTurn<F extends object> (queue: Array<Turn & F>, fields: F, signal: AbortSignal, onGrant: () => void): Promise<void> {
  signal.throwIfAborted()
  await new Promise<void>((resolve, reject) => {
    const onAbort = (): void => {
      const i = queue.indexOf(turn)
      if (i >= 0) queue.splice(i, 1)
      reject(abortReason(signal))
    }
    const turn: Turn & F = {
      ...fields,
      grant: () => { signal.removeEventListener('abort', onAbort); onGrant(); resolve() },
      fail: (err: Error) => { signal.removeEventListener('abort', onAbort); reject(err) },
    }
    signal.addEventListener('abort', onAbort, { once: true })
    queue.push(turn)
  })
}
