/**
 * The batcher's runtime: a queue in front of one engine session. Callers submit one step each and
 * await their own result; one loop asks `planBatch` what to run, hands the batch to the executor
 * (one run at a time) and routes each item's result, or its chunk's remainder back into the queue.
 */
import { DEFAULTS, resolveLimits } from './defaults.ts'
import { OverloadedError } from '../errors.ts'
import { BadStepError, BatchFailedError, ShuttingDownError, abortReason, asCoded } from './errors.ts'
import { createDecodeTimeTable, createRateMeter, createStepTimeEstimator } from './estimator.ts'
import { createBatcherMetrics, recordConfig } from './metrics.ts'
import { planBatch } from './policy.ts'
import { refusalTurn } from './refusal.ts'
import { StepAssembly, checkStep, logitsWindow, sliceInput } from './steps.ts'
import { stepMark } from '../step-trace.ts'
import type { Batcher, BatcherComponents, BatcherInit, BatcherLoad, BatchItem, BatchItemResult, Chunk, ExecutorRun, PendingStep, StepRequest, StepResult } from './types.ts'

interface Entry extends PendingStep {
  tokens: number
  readonly request: StepRequest
  readonly total: number
  readonly keep: number
  /** Positions already run. */
  offset: number
  /** When the step, or its next chunk, became ready to run. */
  readyAt: number
  readonly assembly: StepAssembly
  readonly signal: AbortSignal
  state: 'queued' | 'running' | 'settled'
  resolve (r: StepResult): void
  reject (e: Error): void
  detach (): void
}

const NEVER = new AbortController().signal

export function createBatcher (init: BatcherInit, components: BatcherComponents): Batcher {
  const limits = resolveLimits(init.limits)
  const budgetMs = init.budgetMs ?? DEFAULTS.budgetMs
  const maxQueue = init.maxQueue ?? DEFAULTS.maxQueue
  if (!(budgetMs >= 0)) throw new RangeError(`budgetMs must be ≥ 0, got ${budgetMs}`)
  if (!Number.isSafeInteger(maxQueue) || maxQueue < 1) throw new RangeError(`maxQueue must be a positive integer, got ${maxQueue}`)
  const name = init.name ?? 'default'
  const label = { batcher: name }
  const clock = components.clock ?? { now: () => performance.now() }
  const executor = components.executor
  const estimator = createStepTimeEstimator(init.prior ?? DEFAULTS.prior)
  // Decode steps (one position a sequence) fitted apart: what a sequence slot's turnover costs.
  // The mixed fit extrapolates them badly right after a burst of prefills, when it has seen mostly
  // those (60m fp32: 154 ms for a batch of eight steps that took 17, the slots then telling
  // refused requests to come back 18 s later instead of 1: docs/engine-notes.md, wave 12).
  const decodeEstimator = createStepTimeEstimator(init.prior ?? DEFAULTS.prior)
  // And by row count, each count on its own (estimator.ts): read first, the fit where it cannot say.
  const decodeTable = createDecodeTimeTable()
  const decodeRate = createRateMeter()
  let observedRuns = 0
  let observedDecodes = 0
  let fastestDecode = Infinity
  /** The newest ExecutorRun learnt from. */
  let lastRun = -Infinity
  /** One run's time into the step-time models. */
  const learn = (sequences: number, positions: number, ms: number): void => {
    estimator.observe(sequences, positions, ms)
    observedRuns++
    if (positions !== sequences) return
    decodeEstimator.observe(sequences, positions, ms)
    decodeTable.observe(sequences, ms)
    observedDecodes++
    if (sequences === 1) fastestDecode = Math.min(fastestDecode, ms)
  }
  const metrics = createBatcherMetrics(components.metrics)

  let queue: Entry[] = []
  let queuedTokens = 0
  let nextId = 1
  /** Sequences with a step queued or running: a sequence's steps are sequential. */
  const busy = new Set<string>()
  /** Sequences whose result just went out: expected back soon, so worth waiting for. */
  const recent = new Map<string, number>()
  let running: { sequences: number, tokens: number, startedAt: number } | undefined
  let runDone: Promise<void> = Promise.resolve()
  let controller = new AbortController()
  let timer: ReturnType<typeof setTimeout> | undefined
  let started = false
  /** Where the turns promised to refused prompts end (clock ms; refusal.ts). */
  let promisedUntil = 0

  function expectedWaitMs (now: number): number {
    let wait = running === undefined ? 0 : Math.max(0, running.startedAt + estimator.estimate(running.sequences, running.tokens) - now)
    const n = queue.length
    if (n > 0) {
      const rounds = Math.max(Math.ceil(n / limits.maxBatch), Math.ceil(queuedTokens / limits.maxPositions))
      wait += rounds * estimator.estimate(Math.ceil(n / rounds), Math.ceil(queuedTokens / rounds))
    }
    return wait
  }

  function settle (e: Entry, outcome: { result: StepResult } | { error: Error }): void {
    if (e.state === 'settled') return
    e.state = 'settled'
    busy.delete(e.seqId)
    e.detach()
    if ('result' in outcome) e.resolve(outcome.result)
    else e.reject(outcome.error)
  }

  function dequeue (e: Entry): void {
    const i = queue.indexOf(e)
    if (i < 0) return
    queue.splice(i, 1)
    queuedTokens -= e.tokens
  }

  function kick (): void {
    if (!started || running !== undefined) return
    stepMark('b.kick')
    clearTimeout(timer)
    timer = undefined
    const now = clock.now()
    for (const [seqId, at] of recent) if (now - at >= limits.maxQueueDelayMs) recent.delete(seqId)
    metrics.queueDepth.set(label, queue.length)
    metrics.expectedWait.set(label, expectedWaitMs(now) / 1000)
    if (queue.length === 0) return
    const cap = components.batchCap?.()
    const plan = planBatch(queue, cap === undefined || !(cap >= 1) || cap >= limits.maxBatch ? limits : { ...limits, maxBatch: Math.floor(cap) }, now, { awaiting: recent.size })
    stepMark('b.planned')
    if (plan.run.length > 0) {
      runDone = execute(plan.run, now)
    } else if (plan.wait !== undefined) {
      timer = setTimeout(kick, Math.max(1, Math.ceil(plan.wait)))
    }
  }

  async function execute (chunks: Array<Chunk<Entry>>, now: number): Promise<void> {
    const items: BatchItem[] = []
    const used: number[] = []
    let results: BatchItemResult[] | undefined
    let failure: Error | undefined
    let end = now
    try {
      let tokens = 0
      let decodeTokens = 0
      for (const { step: e, tokens: n } of chunks) {
        dequeue(e)
        e.state = 'running'
        const { ask, use } = logitsWindow(e.total, e.keep, e.offset, n)
        const final = e.offset + n === e.total
        // A verify is checked whole (its drafts against every row); one the planner cut into
        // chunks runs as plain rows and returns its logits (the caller checks those).
        const verify = n === e.total ? e.request.verify : undefined
        items.push({
          seqId: e.seqId,
          kind: e.kind,
          input: sliceInput(e.request.input, e.offset, n, e.total),
          positions: n === e.total ? e.request.positions : e.request.positions.slice(e.offset, e.offset + n),
          logitsToKeep: ask,
          final,
          ...(final && e.request.pick !== undefined ? { pick: e.request.pick } : {}),
          ...(verify === undefined ? {} : { verify, ...(e.request.drafts === undefined ? {} : { drafts: e.request.drafts }) }),
          ...(final && e.request.ahead !== undefined && (e.request.pick !== undefined || verify !== undefined) ? { ahead: e.request.ahead } : {}),
          ...(e.request.reach === undefined ? {} : { reach: e.request.reach }),
          signal: e.signal,
        })
        used.push(use)
        tokens += n
        if (e.kind === 'decode') decodeTokens += n
        metrics.queueDelay.observe({ ...label, kind: e.kind }, Math.max(0, now - e.readyAt) / 1000)
      }
      running = { sequences: items.length, tokens, startedAt: now }
      metrics.batchSize.observe(label, items.length)
      metrics.batchTokens.observe(label, tokens)

      try {
        stepMark('b.exec')
        results = await executor.run(items, controller.signal)
        stepMark('b.ran')
        if (!Array.isArray(results) || results.length !== items.length) {
          failure = new BatchFailedError(`executor returned ${Array.isArray(results) ? results.length : typeof results} results for ${items.length} items`)
        }
      } catch (err) {
        failure = asCoded(err, 'batched run failed')
      }
      end = clock.now()
      metrics.stepTime.observe(label, Math.max(0, end - now) / 1000)
      if (failure === undefined) {
        let ahead = 0
        let aheadTokens = 0
        /** The runs the executor timed itself, each once (one run's results may come in several batches). */
        const timed: ExecutorRun[] = []
        results!.forEach((r, i) => {
          if (!('output' in r)) return
          if (r.ranAhead === true) { ahead++; aheadTokens += items[i]!.positions.length }
          if (r.run !== undefined && r.run.id > lastRun && !timed.some(t => t.id === r.run!.id)) timed.push(r.run)
        })
        if (ahead > 0) metrics.ranAhead.inc(label, ahead)
        if (timed.length > 0) {
          // Where the engine ran them: a batch's wall time is a round trip with whatever ran
          // beside it, and most decode steps are computed ahead, where it sees no time at all
          // (its model of the rest read 2.3× a 60m int4 step; docs/engine-notes.md, wave 25).
          for (const t of timed.sort((a, b) => a.id - b.id)) learn(t.rows, t.positions, t.ms)
          lastRun = timed.at(-1)!.id
        } else if (items.length > ahead) {
          // An executor that does not time its runs: this batch's wall time, less the steps it had
          // computed ahead (they took no run now).
          learn(items.length - ahead, tokens - aheadTokens, end - now)
        }
        decodeRate.add(decodeTokens, end)
      }
      stepMark('b.obs')
      chunks.forEach(({ step: e, tokens: n }, i) => { route(e, n, i) })
      stepMark('b.routed')
    } finally {
      // Whatever went wrong above, nobody from this run is left waiting and the loop goes on.
      for (const { step: e } of chunks) if (e.state === 'running') settle(e, { error: new BatchFailedError('step lost in the batcher') })
      running = undefined
      kick()
    }

    function route (e: Entry, n: number, i: number): void {
      if (e.state === 'settled') return
      const r = failure === undefined ? results?.[i] : { error: failure }
      try {
        if (e.signal.aborted) throw abortReason(e.signal) // the caller has gone: its reason, not the executor's
        if (r === undefined || (!('output' in r) && !('error' in r))) throw new BatchFailedError(`executor returned no result for item ${i}`)
        if ('error' in r) throw asCoded(r.error, `step of ${e.seqId} failed`)
        e.assembly.add(r.output, used[i]!, n)
      } catch (err) {
        settle(e, { error: asCoded(err, `step of ${e.seqId} failed`) })
        return
      }
      e.offset += n
      e.tokens -= n
      if (e.tokens === 0) {
        let result: StepResult
        try { result = e.assembly.finish() } catch (err) { settle(e, { error: asCoded(err, 'assembling step output') }); return }
        recent.set(e.seqId, end)
        settle(e, { result })
      } else if (!started) {
        settle(e, { error: new ShuttingDownError('batcher is not running') })
      } else {
        e.state = 'queued'
        e.readyAt = end
        queue.push(e)
        queuedTokens += e.tokens
      }
    }
  }

  return {
    async start () {
      if (started) return
      started = true
      controller = new AbortController()
      recordConfig(metrics, name, limits, budgetMs)
    },

    async stop () {
      if (!started) { await runDone; return }
      started = false
      clearTimeout(timer)
      timer = undefined
      const stopped = new ShuttingDownError('batcher stopped')
      for (const e of [...queue]) { dequeue(e); settle(e, { error: stopped }) }
      controller.abort(stopped)
      await runDone
      metrics.queueDepth.set(label, 0)
    },

    async submit (step, signal) {
      stepMark('b.submit')
      if (!started) throw new ShuttingDownError('batcher is not running')
      checkStep(step)
      if (signal?.aborted === true) throw abortReason(signal)
      if (busy.has(step.seqId)) throw new BadStepError(`sequence ${step.seqId} already has a step queued or running`)
      const now = clock.now()
      const total = step.positions.length
      if (queue.length >= maxQueue) {
        metrics.refused.inc({ ...label, reason: 'queue_full' })
        // One full run frees maxBatch places.
        throw new OverloadedError(`batcher queue is full (${maxQueue} steps)`, Math.max(1, Math.ceil(estimator.estimate(limits.maxBatch, limits.maxPositions))))
      }
      if (step.kind === 'prefill') {
        const wait = expectedWaitMs(now)
        const budget = step.budgetMs ?? budgetMs
        if (wait > budget) {
          metrics.refused.inc({ ...label, reason: 'overloaded' })
          const turn = refusalTurn(promisedUntil, now, wait, estimator.estimate(1, total))
          promisedUntil = turn.tail
          throw new OverloadedError(`expected queue wait ${Math.round(wait)} ms exceeds the batcher budget of ${budget} ms`, turn.retryAfterMs)
        }
      }
      return await new Promise<StepResult>((resolve, reject) => {
        const s = signal ?? NEVER
        const onAbort = (): void => {
          // A running step ends when its batch returns (the executor sees the signal); a queued one leaves now.
          if (e.state !== 'queued') return
          dequeue(e)
          settle(e, { error: abortReason(s) })
          kick()
        }
        const e: Entry = {
          id: nextId++,
          seqId: step.seqId,
          kind: step.kind,
          tokens: total,
          enqueuedAt: now,
          request: step,
          total,
          keep: step.logitsToKeep ?? 1,
          offset: 0,
          readyAt: now,
          assembly: new StepAssembly(),
          signal: s,
          state: 'queued',
          resolve,
          reject,
          detach: () => s.removeEventListener('abort', onAbort),
        }
        s.addEventListener('abort', onAbort, { once: true })
        queue.push(e)
        queuedTokens += total
        busy.add(e.seqId)
        recent.delete(e.seqId)
        kick()
      })
    },

    release (seqId) {
      recent.delete(seqId)
      kick()
    },

    load (): BatcherLoad {
      const now = clock.now()
      return {
        queueDepth: queue.length,
        inFlight: running?.sequences ?? 0,
        expectedWaitMs: expectedWaitMs(now),
        decodeTokensPerSecond: decodeRate.perSecond(now),
      }
    },
    estimateStepMs (sequences: number, tokens: number = sequences): number {
      // The prior is a guess for another model: say "unknown" (0) until this engine has run.
      if (tokens === sequences && observedDecodes > 0) return decodeTable.estimate(sequences) ?? decodeEstimator.estimate(sequences, tokens)
      return observedRuns === 0 ? 0 : estimator.estimate(sequences, tokens)
    },
    fastestDecodeMs: () => Number.isFinite(fastestDecode) ? fastestDecode : 0,
  }
}
