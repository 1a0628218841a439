/**
 * The client side of a comparison: the same OpenAI /v1/completions request to shoal and to
 * llama-server, streamed and timed where the client sees tokens, plus an untimed pass for the
 * greedy ids. Each server needs its own spelling for the same request (see `complete`).
 */
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import { sseEvents } from './sse.ts'

/** Where a request goes: the server's kind picks the request's dialect. */
export interface Endpoint { kind: 'llama' | 'shoal', url: string, model: string }

/**
 * One streamed completion's token count and times (performance.now()): sent, first and last token
 * chunk, response ended; and the gap before each later token (ms), a chunk's gap shared evenly by
 * the tokens it carried (a server that holds a token back inside a UTF-8 character sends two at once).
 */
export interface Completion { count: number, t0: number, first: number, last: number, end: number, gaps: number[] }

/** 429s answered (and retried after their Retry-After, as the openai client does) per server run. */
const refused = new WeakMap<Endpoint, number>()

/** The 429s `s` answered so far: a run that waited them out timed the wait too, so the report says so. */
export function refusedCount (s: Endpoint): number {
  return refused.get(s) ?? 0
}

/**
 * POST JSON; a 429 is waited out and retried, inside the request's time: for `retry-after-ms` when
 * the server sends it (as the openai SDKs do; shoal sends its estimate there), else Retry-After's
 * whole seconds.
 */
async function post (s: Endpoint, path: string, body: unknown): Promise<Response> {
  for (let attempt = 0, reused = 0; ; attempt++) {
    let res: Response
    try {
      res = await fetch(`${s.url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(600_000) })
    } catch (err) {
      // A kept-alive connection the server closed as it was reused (it idled past the server's
      // keep-alive timeout while the other server of a pair was measured): nothing was answered,
      // so a benchmark's request is sent again, on a new connection.
      if ((err as { cause?: { code?: string } }).cause?.code !== 'UND_ERR_SOCKET' || ++reused > 2) throw err
      continue
    }
    if (res.status === 200) return res
    const text = await res.text()
    if (res.status !== 429 || attempt >= 30) throw new Error(`${s.kind}: HTTP ${res.status}: ${text}`)
    refused.set(s, (refused.get(s) ?? 0) + 1)
    const ms = Number(res.headers.get('retry-after-ms') ?? NaN)
    await sleep(Number.isFinite(ms) && ms >= 0 ? Math.max(ms, 10) : 1000 * Math.max(0.1, Number(res.headers.get('retry-after') ?? 1)))
  }
}

/**
 * One streamed completion at `temperature` (0: greedy), timed where the client sees tokens. Both
 * servers hold back a token whose text ends inside a UTF-8 character; shoal then sends the held
 * ids with the next chunk (return_token_ids), llama-server sends only the newest id but counts
 * every token (`tokens_predicted` under `__verbose`). So tokens are counted, not collected, here;
 * the ids are compared by `greedyIds` below. A completion whose only token is held arrives with
 * the final chunk: that chunk's time is its first token's. llama-server gets `ignore_eos` and
 * `cache_prompt: false` (both sides prefill cold), and when sampling its top-k, min-p and
 * typical-p filters off (both sides draw from the whole vocabulary, or its top `topP` nucleus).
 */
export async function complete (s: Endpoint, prompt: number[], maxTokens: number, temperature: number, topP = 1): Promise<Completion> {
  const body: Record<string, unknown> = { model: s.model, prompt, max_tokens: maxTokens, temperature, stream: true }
  if (temperature > 0) Object.assign(body, { top_p: topP, seed: prompt.length + maxTokens })
  if (s.kind === 'shoal') body.return_token_ids = true
  else Object.assign(body, { ignore_eos: true, cache_prompt: false, verbose: true })
  // Greedy requests keep llama-server's own filters: with top-k off its greedy path softmaxes and
  // sorts the whole vocabulary every token (60m Q4_0: ~117 tok/s instead of ~480, measured).
  if (s.kind === 'llama' && temperature > 0) Object.assign(body, { top_k: 0, min_p: 0, typical_p: 1 })
  const t0 = performance.now()
  const res = await post(s, '/v1/completions', body)
  let count = 0
  let first = NaN
  let last = NaN
  const gaps: number[] = []
  for await (const event of sseEvents(res.body)) {
    const line = event.split('\n').find(l => l.startsWith('data: {'))
    if (line === undefined) continue
    const data = JSON.parse(line.slice(6)) as { error?: unknown, choices?: Array<{ token_ids?: number[], finish_reason?: string | null }>, __verbose?: { tokens_predicted?: number } }
    if (data.error !== undefined) throw new Error(`${s.kind}: stream error: ${JSON.stringify(data.error)}`)
    const n = s.kind === 'shoal' ? count + (data.choices?.[0]?.token_ids?.length ?? 0) : Math.max(count, data.__verbose?.tokens_predicted ?? 0)
    const finished = (data.choices?.[0]?.finish_reason ?? null) !== null
    if (n === count && !(finished && Number.isNaN(first))) continue
    const now = performance.now()
    if (Number.isNaN(first)) first = now
    else if (n > count) for (let k = count; k < n; k++) gaps.push((now - last) / (n - count))
    if (n > count) last = now
    count = n
  }
  if (count === 0) throw new Error(`${s.kind}: no tokens came back`)
  return { count, t0, first, last, end: performance.now(), gaps }
}

/**
 * The greedy ids of a non-streamed completion (shoal: /v1/completions return_token_ids;
 * llama-server: /completion return_tokens, the one route that lists every id). Untimed.
 */
export async function greedyIds (s: Endpoint, prompt: number[], maxTokens: number): Promise<number[]> {
  const [path, body] = s.kind === 'shoal'
    ? ['/v1/completions', { model: s.model, prompt, max_tokens: maxTokens, temperature: 0, return_token_ids: true }]
    : ['/completion', { prompt, n_predict: maxTokens, temperature: 0, ignore_eos: true, cache_prompt: false, return_tokens: true }]
  const res = await post(s, path, body)
  const data = await res.json() as { tokens?: number[], choices?: Array<{ token_ids?: number[] }> }
  return (s.kind === 'shoal' ? data.choices?.[0]?.token_ids : data.tokens) ?? []
}
