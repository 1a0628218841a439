/**
 * Bounded load through the real `openai` client: `concurrency` workers, each sending one greedy
 * completion at a time (token-id prompts, `return_token_ids`, streamed or whole at random) to a
 * random ingress that is up, for a random model, until `signal` aborts. Every request has a hard
 * bound: still open after `boundMs` it is aborted and counted as a hang. Every 200 must name its
 * receipt (`x-shoal-receipt` / the last chunk's `shoal.receipt_id`); those are the acknowledged
 * receipts the suite checks afterwards.
 */
import OpenAI, { APIError } from 'openai'
import type { CompletionCreateParams } from 'openai/resources/completions'
import { classifyFailure, classifySuccess } from './verdict.ts'
import type { Outcome } from './verdict.ts'

export interface LoadTarget {
  name: string
  url: string
  /** True while the suite has this ingress down (killed, stopped, partitioned). */
  down (): boolean
}

export interface LoadInit {
  targets: LoadTarget[]
  models: string[]
  prompts: number[][]
  maxTokens: number
  concurrency: number
  boundMs: number
  /** The reference tokens for (model, prompt index); undefined when none is known. */
  expected (model: string, prompt: number): number[] | undefined
  /** The fault phase now (tags each request). */
  phase (): string
  signal: AbortSignal
  random?: () => number
  /** Called with each outcome as it settles. */
  onOutcome?: (o: Outcome) => void
}

export interface Acknowledged { ingress: string, receiptId: string, phase: string }

export interface LoadResult {
  outcomes: Outcome[]
  acknowledged: Acknowledged[]
}

interface TokenChoice { finish_reason?: string | null, token_ids?: number[] }

const clients = new Map<string, OpenAI>()
function clientFor (url: string): OpenAI {
  let c = clients.get(url)
  // No retries: a retry would hide what the mesh answered. The suite's own bound decides hangs.
  if (c === undefined) clients.set(url, c = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 24 * 3600_000 }))
  return c
}

/** Sends one request and classifies what came back. */
export async function sendOne (target: LoadTarget, model: string, prompt: number[], expected: number[] | undefined, opts: { stream: boolean, maxTokens: number, boundMs: number, phase: string }): Promise<Outcome> {
  const started = Date.now()
  const bound = new AbortController()
  let timedOut = false
  const timer = setTimeout(() => { timedOut = true; bound.abort() }, opts.boundMs)
  const base = { phase: opts.phase, ingress: target.name, model, stream: opts.stream }
  const params = { model, prompt, max_tokens: opts.maxTokens, temperature: 0, return_token_ids: true } as CompletionCreateParams & { return_token_ids: boolean }
  const client = clientFor(target.url)
  try {
    let finish: string | null | undefined
    let receiptId: string | null | undefined
    const ids: number[] = []
    if (opts.stream) {
      const { data: stream } = await client.completions.create({ ...params, stream: true } as CompletionCreateParams & { stream: true }, { signal: bound.signal }).withResponse()
      for await (const chunk of stream) {
        const c = chunk.choices[0] as unknown as TokenChoice | undefined
        if (c !== undefined) {
          ids.push(...(c.token_ids ?? []))
          if (c.finish_reason != null) finish = c.finish_reason
        }
        const shoal = (chunk as unknown as { shoal?: { receipt_id?: string } }).shoal
        if (shoal?.receipt_id !== undefined) receiptId = shoal.receipt_id
      }
    } else {
      const { data, response } = await client.completions.create({ ...params, stream: false } as CompletionCreateParams & { stream: false }, { signal: bound.signal }).withResponse()
      const c = data.choices[0] as unknown as TokenChoice | undefined
      finish = c?.finish_reason
      ids.push(...(c?.token_ids ?? []))
      receiptId = response.headers.get('x-shoal-receipt')
    }
    const kind = classifySuccess({ finishReason: finish, tokenIds: ids, expected, receiptId })
    return { ...base, kind, ms: Date.now() - started, ...(receiptId == null ? {} : { receiptId }), ...(kind === 'wrong' ? { detail: `got ${ids.length} tokens [${ids.slice(0, 8).join(',')}…], expected [${expected?.slice(0, 8).join(',')}…]` } : {}) }
  } catch (err) {
    const apiError = err instanceof APIError ? err : undefined
    // APIConnectionError and its subclasses are APIErrors without a status: no HTTP answer.
    const connection = apiError === undefined || (apiError.status === undefined && apiError.error === undefined)
    const body = apiError?.error as { code?: string, type?: string } | undefined
    const kind = classifyFailure({
      timedOut,
      connection,
      ingressDown: target.down(),
      ...(apiError?.status === undefined ? {} : { status: apiError.status }),
      code: body?.code ?? null,
      type: body?.type ?? null,
      shaped: body !== undefined && typeof body === 'object',
    })
    return {
      ...base, kind, ms: Date.now() - started,
      ...(apiError?.status === undefined ? {} : { status: apiError.status }),
      ...(body?.code === undefined ? {} : { code: body.code }),
      detail: String((err as Error).message ?? err).slice(0, 200),
    }
  } finally {
    clearTimeout(timer)
  }
}

export async function runLoad (init: LoadInit): Promise<LoadResult> {
  const random = init.random ?? Math.random
  const pick = <T>(xs: T[]): T => xs[Math.floor(random() * xs.length)]!
  const outcomes: Outcome[] = []
  const acknowledged: Acknowledged[] = []
  const worker = async (): Promise<void> => {
    while (!init.signal.aborted) {
      const up = init.targets.filter(t => !t.down())
      if (up.length === 0) { await new Promise(resolve => setTimeout(resolve, 100)); continue }
      const target = pick(up)
      const model = pick(init.models)
      const p = Math.floor(random() * init.prompts.length)
      const phase = init.phase()
      const o = await sendOne(target, model, init.prompts[p]!, init.expected(model, p), { stream: random() < 0.5, maxTokens: init.maxTokens, boundMs: init.boundMs, phase })
      outcomes.push(o)
      if (o.kind === 'ok' && o.receiptId !== undefined) acknowledged.push({ ingress: target.name, receiptId: o.receiptId, phase })
      init.onOutcome?.(o)
      // A failed request is retried by a real client after a moment, not in a tight loop.
      if (o.kind !== 'ok') await new Promise(resolve => setTimeout(resolve, 50 + random() * 200))
    }
  }
  await Promise.all(Array.from({ length: init.concurrency }, worker))
  return { outcomes, acknowledged }
}

/** One greedy completion's token ids (the reference a run is compared with); throws unless a whole 200. */
export async function referenceTokens (url: string, model: string, prompt: number[], maxTokens: number): Promise<number[]> {
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model, prompt, max_tokens: maxTokens, temperature: 0, return_token_ids: true }),
    signal: AbortSignal.timeout(60_000),
  })
  const body = await res.json() as { choices?: Array<{ token_ids?: number[], finish_reason?: string }> }
  const ids = body.choices?.[0]?.token_ids
  if (res.status !== 200 || ids === undefined || ids.length !== maxTokens) throw new Error(`reference ${model}: ${res.status} ${JSON.stringify(body).slice(0, 300)}`)
  return ids
}
