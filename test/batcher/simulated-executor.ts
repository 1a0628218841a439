/**
 * SimulatedExecutor: a stand-in engine for the batcher's control-plane tests — no weights, no
 * onnxruntime. A run costs `fixedMs + perTokenMs × positions` of wall time (a real timer, so
 * concurrency is real) and its outputs are a pure function of each item, so a test can check that
 * every caller got its own result:
 *   token input  → logits rows [hash(seqId), position, tokenId, 0] for the last `logitsToKeep` positions
 *   hidden input → the same rows, each value + 1
 *   with a pick  → the token hash(seqId) + last position
 *   a verify     → a verdict: every draft but the last stood, the token hash(seqId) + last position
 */
import { AbortedError } from '../../daemon/errors.ts'
import type { BatchExecutor, BatchItem, BatchItemResult, StepResult } from '../../daemon/batcher/index.ts'

export const SIM_VOCAB = 4

export interface SimulatedExecutorOptions {
  fixedMs?: number
  perTokenMs?: number
  /** An error here fails the whole run. */
  failRun?: (items: BatchItem[]) => Error | undefined
  /** An error here fails one item. */
  failItem?: (item: BatchItem) => Error | undefined
}

export interface RecordedItem {
  seqId: string
  kind: BatchItem['kind']
  positions: number[]
  logitsToKeep: number
  final: boolean
  picks: boolean
  /** A greedy verify (BatchItem.verify), and the run-ahead picks it carried. */
  verify: boolean
  ahead: number | undefined
}

export function seqHash (seqId: string): number {
  let h = 0
  for (const ch of seqId) h = (h * 31 + ch.charCodeAt(0)) % 65_521
  return h
}

export class SimulatedExecutor implements BatchExecutor {
  readonly batches: RecordedItem[][] = []
  private readonly options: SimulatedExecutorOptions
  private gate: Promise<void> | undefined
  private openGate: (() => void) | undefined
  private active = 0
  maxConcurrentRuns = 0

  constructor (options: SimulatedExecutorOptions = {}) {
    this.options = options
  }

  /** Runs wait until `release()` (to hold a batch in flight while a test queues more). */
  hold (): void {
    this.gate = new Promise(resolve => { this.openGate = resolve })
  }

  release (): void {
    this.openGate?.()
    this.gate = undefined
  }

  async run (items: BatchItem[], signal: AbortSignal): Promise<BatchItemResult[]> {
    this.active++
    this.maxConcurrentRuns = Math.max(this.maxConcurrentRuns, this.active)
    try {
      this.batches.push(items.map(i => ({ seqId: i.seqId, kind: i.kind, positions: [...i.positions], logitsToKeep: i.logitsToKeep, final: i.final, picks: i.pick !== undefined, verify: i.verify !== undefined, ahead: i.ahead?.length })))
      const tokens = items.reduce((sum, i) => sum + i.positions.length, 0)
      await this.gate
      await sleep((this.options.fixedMs ?? 1) + (this.options.perTokenMs ?? 0.02) * tokens, signal)
      const failure = this.options.failRun?.(items)
      if (failure !== undefined) throw failure
      return items.map(item => {
        const error = this.options.failItem?.(item) ?? (item.signal.aborted ? new AbortedError('step was cancelled') : undefined)
        return error === undefined ? { output: simulate(item) } : { error }
      })
    } finally {
      this.active--
    }
  }
}

/** The result the simulated engine gives one item. */
export function simulate (item: BatchItem): StepResult {
  const n = item.positions.length
  if (item.pick !== undefined) return { kind: 'token', id: seqHash(item.seqId) + item.positions[n - 1]! }
  if (item.verify !== undefined) return { kind: 'verdict', accepted: n - 2, id: seqHash(item.seqId) + item.positions[n - 1]! }
  const rows = (from: number, count: number): Float32Array => {
    const data = new Float32Array(count * SIM_VOCAB)
    for (let r = 0; r < count; r++) {
      const at = from + r
      data.set([seqHash(item.seqId), item.positions[at]!, 'tokenIds' in item.input ? item.input.tokenIds[at]! : 0, 0], r * SIM_VOCAB)
    }
    return data
  }
  if ('tokenIds' in item.input) {
    const k = Math.min(item.logitsToKeep, n)
    return { kind: 'logits', data: rows(n - k, k), count: k, vocab: SIM_VOCAB }
  }
  const width = item.input.hidden.length / n
  return { kind: 'hidden', data: item.input.hidden.map(v => v + 1), count: n, hidden: width }
}

function sleep (ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) { reject(signal.reason as Error); return }
    const timer = setTimeout(() => { signal.removeEventListener('abort', onAbort); resolve() }, ms)
    const onAbort = (): void => { clearTimeout(timer); reject(signal.reason as Error) }
    signal.addEventListener('abort', onAbort, { once: true })
  })
}

/** A result with rows (logits or hidden), failing the test on a token. */
export function rowsOf (r: StepResult): Extract<StepResult, { kind: 'logits' | 'hidden' }> {
  if (r.kind === 'token' || r.kind === 'verdict') throw new Error(`expected rows, got a ${r.kind}`)
  return r
}
