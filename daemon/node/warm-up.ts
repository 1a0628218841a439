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
 * (warmUpGoesOn). A request that fails is logged and the warm-up goes on to the next.
 */
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

/** The engines by model id, with every request marked as the warm-up's. */
function warmUpService (engines: readonly LocalService[]): InferenceService {
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
  /** Requests that did not (an error reply, or cut at the budget). */
  failed: number
  ms: number
}

/** Runs the warm-up on `engines`; resolves when done or at the budget, never rejects. */
export async function warmUp (engines: readonly LocalService[], logger: Logger, plan: WarmUpPlan = WARM_UP): Promise<WarmUpReport> {
  const began = performance.now()
  const report: WarmUpReport = { completed: 0, failed: 0, ms: 0 }
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
          else {
            report.failed++
            logger.debug({ model: card.id, url: request.url, status: res.statusCode, body: res.body.slice(0, 200) }, 'warm-up request failed')
          }
        } catch (err) {
          report.failed++
          logger.debug({ err, model: card.id, url: request.url }, 'warm-up request cut')
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
