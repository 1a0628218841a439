/**
 * The start-up warm-up: before the API listens, the node sends its own whole-model engines a few
 * requests through a throwaway ingress (the same HTTP code a client's request takes, by fastify's
 * inject, with no socket), and drops what they answer.
 *
 * Why: a fresh node's first request ran slower than the ones after it. 60m int4 on two cores, a
 * 128-token prompt: TTFT 50–78 ms against 35–40 from the second request on. V8 compiles the
 * request path's JavaScript on first use (~8–15 ms more of the main thread; more where nothing
 * was compiled before), then optimises it on a background thread (~30 ms of one core right
 * after), and both compete with the prefill for the two cores (docs/engine-notes.md, wave 22).
 * With the warm-up the first request's TTFT was 39–42 ms. llama-server runs a warm-up at start
 * too. What it does not change: decode still speeds up ~10 % over a fresh node's first ~1,000
 * tokens.
 *
 * What it leaves: nothing a client, a peer or an operator sees as a request.
 * - No receipt: the throwaway ingress talks to the engines, not the receipted service.
 * - No request metrics: the throwaway ingress counts into its own registry.
 * - No kept prefix, no prefill rate: its requests carry `warmUp` (daemon/service.ts).
 * - Never routed to a peer.
 * The engines' own metrics (batches, steps, speculation) do count its steps: they ran.
 *
 * Bounded: the requests run one at a time; the whole warm-up stops at WARM_UP.budgetMs, and after
 * its first, small request on a model whose decode steps are too slow for a warm-up to matter
 * (warmUpGoesOn). A request that fails is logged and the warm-up goes on to the next; one the
 * budget cuts counts as cut, not failed: a cold first request (weights still on disk, 250m int4
 * on two cores) can take longer than the budget, and nothing is wrong.
 */
import { randomUUID } from 'node:crypto'
import { setTimeout as sleep } from 'node:timers/promises'
import type { Logger } from 'pino'
import { Registry } from 'prom-client'
import type { LocalService } from '../engine/index.ts'
import { createIngress } from '../ingress/index.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'

/** What the warm-up sends and its bounds (WARM_UP below; tests pass their own). */
export interface WarmUpPlan {
  /** [prompt tokens, new tokens] of each completion; the chat comes second. */
  readonly completions: ReadonlyArray<readonly [number, number]>
  readonly chatTokens: number
  /** The whole warm-up's bound, every engine's included. */
  readonly budgetMs: number
  /**
   * A model whose one-sequence decode step, as its engine measured it over the first request, is
   * slower than this (250m fp32 on two cores: ~22 ms) gets only that first request: its steps
   * dwarf the warm-up's saving (tens of µs a token) and the rest would only delay the start.
   * Judged by the step, not the first request's time: that request is the cold one, and on a
   * slower machine took over 100 ms on 60m int4 (2.4 ms a step).
   */
  readonly slowStepMs: number
  /** The settle after the API listens (settle() below); tokens 0: none. */
  readonly settle: {
    /** Decode tokens per engine. */
    readonly tokens: number
    /** The whole settle's bound, every engine's included. */
    readonly budgetMs: number
  }
}

/**
 * Four requests, growing: the first small (a slow model's warm-up stops after it, below), a chat
 * so the tokenizer and the chat template run, then two of a 128-token prompt. As measured on 60m
 * int4, the first client request still ran ~5 ms slower when only two full requests came before it
 * (the optimising of the last one's code ran into it). Few new tokens each: with 8 / 32 / 32 / 32
 * a fresh server started 11–15 % later (60m fp32: ~2.1 against ~1.8 s) for the same first TTFT,
 * and its first decode was not resolvably faster (0.965–1.003 of it, ±5 %; docs/engine-notes.md,
 * wave 23).
 */
export const WARM_UP: WarmUpPlan = Object.freeze({
  completions: Object.freeze([[16, 4], [128, 12], [128, 12]] as const),
  chatTokens: 12,
  budgetMs: 1_000,
  slowStepMs: 10,
  // 60m int4 on two cores: ~2 s of a 2 ms step; 60m fp32 (~4 ms) stops at the budget.
  settle: Object.freeze({ tokens: 1_024, budgetMs: 3_000 }),
})

/** One warm-up request: the route and its JSON body. */
export interface WarmUpRequest {
  url: '/v1/completions' | '/v1/chat/completions'
  body: Record<string, unknown>
}

/**
 * The warm-up's requests for one model, streamed and greedy: completions of token-id prompts (ids
 * every vocabulary has) and, second, a chat. Each prompt and each answer fits a quarter of the
 * model's context.
 */
export function warmUpRequests (card: Pick<ModelCard, 'id' | 'contextLength'>, plan: WarmUpPlan = WARM_UP): WarmUpRequest[] {
  const fit = (n: number): number => Math.max(1, Math.min(n, Math.floor(card.contextLength / 4)))
  const common = { model: card.id, temperature: 0, stream: true }
  // Ids 3–258: past the usual special tokens, inside any vocabulary of at least 259.
  const completions = plan.completions.map(([prompt, answer]): WarmUpRequest => ({
    url: '/v1/completions',
    body: { ...common, max_tokens: fit(answer), prompt: Array.from({ length: fit(prompt) }, (_, i) => 3 + (i * 101) % 256) },
  }))
  const chat: WarmUpRequest = {
    url: '/v1/chat/completions',
    body: { ...common, max_tokens: fit(plan.chatTokens), messages: [{ role: 'user', content: 'Say something about the sea, the tides and the boats.' }] },
  }
  return [...completions.slice(0, 1), chat, ...completions.slice(1)]
}

/**
 * Whether the warm-up sends another request: not past the budget, and not to a model whose decode
 * step (`stepMs`, unknown before its first request) is slower than `slowStepMs`: the start-up
 * time it would cost buys nothing a client would notice.
 */
export function warmUpGoesOn (elapsedMs: number, stepMs: number | undefined, plan: WarmUpPlan = WARM_UP): boolean {
  return elapsedMs < plan.budgetMs && (stepMs === undefined || stepMs <= plan.slowStepMs)
}

/** What the warm-up asks of an engine: its models, a request, and its measured decode step. */
export type WarmUpEngine = Pick<LocalService, 'models' | 'generate' | 'decodeStepMs'>

/** The engines by model id, with every request marked as the warm-up's. */
function warmUpService (engines: readonly WarmUpEngine[]): InferenceService {
  return {
    models: () => engines.flatMap(e => e.models()),
    generate (request: GenerateRequest, signal: AbortSignal): AsyncIterable<GenerateEvent> {
      const engine = engines.find(e => e.models().some(card => card.id === request.model))
      // The ingress only sends the ids models() lists.
      if (engine === undefined) throw new Error(`warm-up: no engine serves ${request.model}`)
      return engine.generate({ ...request, warmUp: true }, signal)
    },
  }
}

export interface WarmUpReport {
  /** Requests that completed (HTTP 200 with a whole stream). */
  completed: number
  /** Requests cut at the budget (the warm-up's own bound, not a fault). */
  cut: number
  /** Requests that failed: an error reply, or an error before the budget. */
  failed: number
  ms: number
}

/** Runs the warm-up on `engines`; resolves when done or at the budget, never rejects. */
export async function warmUp (engines: readonly WarmUpEngine[], logger: Logger, plan: WarmUpPlan = WARM_UP): Promise<WarmUpReport> {
  const began = performance.now()
  const report: WarmUpReport = { completed: 0, cut: 0, failed: 0, ms: 0 }
  if (engines.length === 0) return report
  const budget = AbortSignal.timeout(plan.budgetMs)
  const ingress = createIngress({ logger: false, requestTimeoutMs: plan.budgetMs }, { service: warmUpService(engines), metrics: new Registry() })
  try {
    for (const [engine, card] of engines.flatMap(e => e.models().map(c => [e, c] as const))) {
      let stepMs: number | undefined
      for (const request of warmUpRequests(card, plan)) {
        if (!warmUpGoesOn(performance.now() - began, stepMs, plan)) break
        try {
          const res = await ingress.app.inject({ method: 'POST', url: request.url, payload: request.body, signal: budget })
          // A stream that failed after its start ends with an error event, still under 200.
          if (res.statusCode === 200 && !res.body.includes('"error"')) report.completed++
          else if (budget.aborted) {
            report.cut++
            logger.debug({ model: card.id, url: request.url, status: res.statusCode }, 'warm-up request cut at its budget')
          } else {
            report.failed++
            logger.debug({ model: card.id, url: request.url, status: res.statusCode, body: res.body.slice(0, 200) }, 'warm-up request failed')
          }
        } catch (err) {
          if (budget.aborted) report.cut++
          else report.failed++
          logger.debug({ err, model: card.id, url: request.url }, budget.aborted ? 'warm-up request cut at its budget' : 'warm-up request failed')
        }
        const measured = engine.decodeStepMs()
        if (measured > 0) stepMs = measured
      }
    }
  } finally {
    await ingress.stop().catch(() => {})
  }
  report.ms = Math.round(performance.now() - began)
  logger.info({ ...report }, 'warmed up')
  return report
}

/**
 * Why a settle ended: its tokens decoded on every engine, its budget spent, another request came,
 * the node stopping. (An engine whose step is slower than slowStepMs is skipped, as the warm-up
 * skips it.)
 */
export type SettleEnd = 'done' | 'budget' | 'request' | 'stopping'

/** What settle() decides at each of its tokens, as a pure function. */
export interface SettleState {
  elapsedMs: number
  /** Tokens this engine's settle has decoded so far. */
  tokens: number
  /** Requests in flight on this node other than the settle's own. */
  others: number
  /** The engine's measured one-sequence decode step; 0 while unknown. */
  stepMs: number
}

/**
 * 'next' moves on to the next engine (this one has its tokens, or its steps are too slow for a
 * settle to matter); undefined goes on. Another request ends the settle at once: it is there only
 * for a node with nothing else to do.
 */
export function settleVerdict (s: SettleState, plan: WarmUpPlan = WARM_UP): Exclude<SettleEnd, 'stopping' | 'done'> | 'next' | undefined {
  if (s.others > 0) return 'request'
  if (s.elapsedMs >= plan.settle.budgetMs) return 'budget'
  if (s.tokens >= plan.settle.tokens || s.stepMs > plan.slowStepMs) return 'next'
  return undefined
}

export interface SettleReport {
  tokens: number
  ms: number
  ended: SettleEnd
}

/**
 * After the API listens: each whole-model engine in turn decodes a throwaway greedy sequence
 * (a `warmUp` request: no receipt, no request metric, no kept prefix) while the node has nothing
 * else to do, up to plan.settle.tokens, within plan.settle.budgetMs. It stops as another request
 * enters one of `engines` (LocalService.onRequest, before that request's first step), and at its
 * next token once `busy` (every request on the node, its own included: chains', stages') counts
 * another.
 *
 * Why: a fresh engine decodes ~20 % slower over its first thousand-odd tokens, and it is the
 * engine's own decode steps that warm it, not time (60m int4, the first 256-token decode of a
 * fresh server: 397–422 tok/s; with 600 more tokens in the warm-up 476–511, 1.20–1.21× over eight
 * fresh starts; 1.4 s of idle time instead: 1.05, inside the noise; docs/engine-notes.md, wave 25;
 * the cause is not known, wave 24). Before listening those steps would double a start (1.4 →
 * 2.7 s); after it, a client that asks at once costs the settle the rest of its tokens and waits
 * at most the step in flight. While it runs the node's load shows one sequence, as it is.
 */
export async function settle (engines: readonly LocalService[], busy: () => number, logger: Logger, signal: AbortSignal, plan: WarmUpPlan = WARM_UP): Promise<SettleReport> {
  const began = performance.now()
  const report: SettleReport = { tokens: 0, ms: 0, ended: 'done' }
  /** Aborted by a client's request to any of the engines, before anything of it runs. */
  const arrived = new AbortController()
  const unsubscribe = engines.map(e => e.onRequest(() => { arrived.abort() }))
  const end = (ended: SettleEnd): SettleReport => {
    report.ended = signal.aborted ? 'stopping' : arrived.signal.aborted ? 'request' : ended
    report.ms = Math.round(performance.now() - began)
    if (report.tokens > 0 || report.ended !== 'done') logger.info({ ...report }, 'settled')
    return report
  }
  try {
    if (plan.settle.tokens <= 0) return end('done')
    // Stopped by either: the settle's sequence is freed at once, so the request's first step runs
    // without the settle's steps beside it (a request seen only at the settle's next token waited
    // for the worker's run ahead: a fresh server's first TTFT 35 → 42 ms, 60m int4).
    const stop = AbortSignal.any([signal, arrived.signal])
    // The warm-up's last sequence is freed just after its response ends (the free goes through the
    // engine's worker); one still busy after that is a client's (a chain's, a stage's: busy()).
    for (let waited = 0; busy() > 0 && waited < SETTLE_START_WAIT_MS && !stop.aborted; waited += 5) await sleep(5)
    for (const [engine, card] of engines.flatMap(e => e.models().map(c => [e, c] as const))) {
      let tokens = 0
      /** Its own sequence: 1 while it holds one. */
      let own = 0
      const verdict = (): ReturnType<typeof settleVerdict> => settleVerdict({ elapsedMs: performance.now() - began, tokens, others: busy() - own, stepMs: engine.decodeStepMs() }, plan)
      for (let salt = 0; ; salt++) {
        if (stop.aborted) return end('stopping')
        const v = verdict()
        if (v === 'next') break
        if (v !== undefined) return end(v)
        const cut = new AbortController()
        try {
          for await (const event of engine.generate(settleRequest(card, plan.settle.tokens - tokens, began + plan.settle.budgetMs, salt), AbortSignal.any([stop, cut.signal]))) {
            if (event.type === 'start') own = 1
            if (event.type !== 'delta') continue
            tokens += event.tokenIds.length
            report.tokens += event.tokenIds.length
            if (verdict() !== undefined) { cut.abort(); break }
          }
        } catch (err) {
          // Its own abort, the node's, a request's, or the budget's deadline: the checks above say
          // which. Else (an engine that fails) nothing is worth retrying for a warm-up.
          if (!cut.signal.aborted && !stop.aborted && performance.now() - began < plan.settle.budgetMs) {
            logger.debug({ err, model: card.id }, 'settle request failed')
            break
          }
        } finally {
          own = 0
        }
      }
    }
    return end('done')
  } finally {
    for (const u of unsubscribe) u()
  }
}

/** How long a settle waits for the warm-up's last sequence to be freed before it starts. */
const SETTLE_START_WAIT_MS = 100

/**
 * A settle's request: greedy, after a one-token prompt (an id as the warm-up's, another each
 * time). One token, because a client that asks while the settle prefills waits for that run: a
 * 128-token prompt made a fresh server's first TTFT 67 ms instead of 37 (60m int4, cold-start.ts).
 */
function settleRequest (card: Pick<ModelCard, 'id' | 'contextLength'>, tokens: number, deadline: number, salt: number): GenerateRequest {
  return {
    requestId: `settle-${randomUUID()}`,
    model: card.id,
    prompt: { kind: 'tokens', ids: [3 + (salt * 101) % 256] },
    maxTokens: Math.max(1, Math.min(tokens, Math.floor(card.contextLength / 2))),
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    // Epoch milliseconds, from the settle's own start on the performance clock.
    deadline: Date.now() + Math.max(0, deadline - performance.now()),
    warmUp: true,
  }
}
