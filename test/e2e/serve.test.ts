/**
 * Single-node serving end to end: the real `openai` client against the real daemon (createDaemon
 * in serve mode — ledger, onnxruntime engine in a worker thread, HTTP ingress) serving a tiny
 * random-weight Llama compiled to a shard directory. Greedy output is checked token for token
 * against the independent float64 reference over a whole 64-token completion; receipts are
 * checked with nothing but JCS, sha256 and ed25519 against the key inside the node's peer id; the
 * receipt log is verified by `shoal receipts verify` after the daemon stops.
 */
import { createHash } from 'node:crypto'
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import canonicalizeModule from 'canonicalize'
import { Tokenizer } from '@huggingface/tokenizers'
import { peerIdFromString } from '@libp2p/peer-id'
import { APIUserAbortError, RateLimitError } from 'openai'
import type { Completion, CompletionCreateParams } from 'openai/resources/completions'
import { verifyDocument } from '../../certs/signed.ts'
import type { SignedDocument } from '../../certs/signed.ts'
import { DEFAULT_MAX_SEQUENCES } from '../../daemon/engine/index.ts'
import type { Budgets } from '../../daemon/node/config.ts'
import { main } from '../../scripts/cli.ts'
import type { ShardManifest } from '../../shards/index.ts'
import { ReferenceModel } from '../support/reference.ts'
import { MODEL_ID, makeTinyCheckpoint, startDaemon, waitFor } from './daemon.ts'
import type { RunningDaemon, TinyCheckpoint } from './daemon.ts'

const canonicalize = canonicalizeModule as unknown as (value: unknown) => string
const sha256Hex = (text: string): string => createHash('sha256').update(text, 'utf8').digest('hex')

/** The prompt test/shards/greedy.test.ts proves the compiled graphs on. */
const PROMPT = 'The quick brown fox jumps over the lazy dog. Once upon a time'
const USER = [{ role: 'user' as const, content: 'What is the capital of France?' }]
/** The local engine's admission bound: more concurrent sequences get 429. */
const CONCURRENCY = DEFAULT_MAX_SEQUENCES

/** vLLM's extension fields on a completion choice. */
interface TokenChoice { text: string, finish_reason: string, prompt_token_ids?: number[], token_ids?: number[] }
type TokenParams = CompletionCreateParams & { return_token_ids?: boolean }

let ck: TinyCheckpoint
let d: RunningDaemon
let manifest: ShardManifest
let manifestFileHash: string
let promptIds: number[]

beforeAll(async () => {
  ck = await makeTinyCheckpoint({ compile: true })
  const manifestBytes = await readFile(join(ck.shardDir, 'manifest.json'))
  manifest = JSON.parse(manifestBytes.toString('utf8')) as ShardManifest
  manifestFileHash = createHash('sha256').update(manifestBytes).digest('hex')
  const tok = new Tokenizer(
    JSON.parse(await readFile(join(ck.modelDir, 'tokenizer.json'), 'utf8')),
    JSON.parse(await readFile(join(ck.modelDir, 'tokenizer_config.json'), 'utf8')),
  )
  promptIds = tok.encode(PROMPT).ids
  d = await startDaemon(ck.shardDir, ck.root)
})
afterAll(async () => {
  await d?.stop()
  await ck?.cleanup()
})

/** A non-streaming token-id completion with return_token_ids (from this file's daemon unless another client is given). */
async function complete (params: Omit<TokenParams, 'model' | 'stream'>, client = d.client): Promise<{ choice: TokenChoice, data: Completion, headers: Headers }> {
  const { data, response } = await client.completions.create({ model: MODEL_ID, ...params, stream: false } as CompletionCreateParams & { stream: false }).withResponse()
  return { choice: data.choices[0] as unknown as TokenChoice, data, headers: response.headers }
}

/** A streaming token-id completion with return_token_ids: every chunk's choice, in order. */
async function completeStreaming (params: Omit<TokenParams, 'model' | 'stream'>): Promise<{ choices: TokenChoice[], last: Record<string, unknown>, receipt: string | null }> {
  const { data: stream, response } = await d.client.completions.create({ model: MODEL_ID, ...params, stream: true } as CompletionCreateParams & { stream: true }).withResponse()
  const choices: TokenChoice[] = []
  let last: Record<string, unknown> = {}
  for await (const chunk of stream) {
    last = chunk as unknown as Record<string, unknown>
    if (chunk.choices[0] !== undefined) choices.push(chunk.choices[0] as unknown as TokenChoice)
  }
  return { choices, last, receipt: response.headers.get('x-shoal-receipt') }
}

/** GET /v1/receipts/{id}: the status and the raw JSON. */
async function fetchReceipt (id: string, at: RunningDaemon = d): Promise<{ status: number, json: Record<string, any> }> {
  const res = await fetch(`${at.url}/v1/receipts/${encodeURIComponent(id)}`)
  return { status: res.status, json: await res.json() as Record<string, any> }
}

/** The signed receipt document behind GET /v1/receipts/{id}. */
async function getReceipt (id: string, at: RunningDaemon = d): Promise<{ status: number, doc: SignedDocument<Record<string, any>> }> {
  const { status, json } = await fetchReceipt(id, at)
  return { status, doc: json as SignedDocument<Record<string, any>> }
}

/** `use` on a daemon of its own over the same shard with these budgets, stopped and removed after. */
async function withOwnDaemon (name: string, budgets: Partial<Budgets>, use: (daemon: RunningDaemon) => Promise<void>): Promise<void> {
  const root = await mkdtemp(join(tmpdir(), `shoal-serve-${name}-`))
  const own = await startDaemon(ck.shardDir, root, { budgets })
  try {
    await use(own)
  } finally {
    await own.stop()
    await rm(root, { recursive: true, force: true })
  }
}

describe('shoal serve: the openai client against the real daemon', () => {
  it('lists the served model', async () => {
    const page = await d.client.models.list()
    expect(page.data.map(m => m.id)).toEqual([MODEL_ID])
    expect(page.data[0]).toMatchObject({ object: 'model', owned_by: 'shoal', context_length: 2048, served_by: [d.peerId] })
  })

  it('exposes the batcher and the ingress on /metrics (batch size, queue delay, step time, time to first token)', async () => {
    await complete({ prompt: promptIds, max_tokens: 4, temperature: 0 })
    const text = await (await fetch(`${d.url}/metrics`)).text()
    for (const name of ['shoal_batch_size_count', 'shoal_batch_queue_delay_seconds_count', 'shoal_batch_step_seconds_count', 'shoal_time_to_first_token_seconds_count', 'shoal_budget_ms{budget="batchBudgetMs"}', 'shoal_budget_ms{budget="networkIdleMs"}', 'shoal_budget_ms{budget="requestTimeoutMs"}']) {
      expect(text, name).toContain(name)
    }
  })

  it('a repeated prompt reuses its kept KV prefix: the same tokens, and /metrics counts the reused tokens', async () => {
    const hits = async (): Promise<number> => {
      const text = await (await fetch(`${d.url}/metrics`)).text()
      const m = /^shoal_kv_prefix_hit_tokens_total\{model="[^"]*"\} (\d+)$/m.exec(text)
      return m === null ? 0 : Number(m[1])
    }
    const prompt = [...promptIds, ...promptIds, ...promptIds] // long enough for whole 16-token blocks
    const first = await complete({ prompt, max_tokens: 8, temperature: 0, return_token_ids: true })
    const before = await hits()
    const again = await complete({ prompt, max_tokens: 8, temperature: 0, return_token_ids: true })
    expect(again.choice.token_ids).toEqual(first.choice.token_ids)
    // All but the last two prompt positions came from the first request's kept KV.
    expect(await hits() - before).toBe(prompt.length - 2)
  })

  it('chat: streaming and non-streaming give the same greedy text, finish reason and usage', async () => {
    const { data, response } = await d.client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 24, temperature: 0 }).withResponse()
    expect(data.object).toBe('chat.completion')
    const choice = data.choices[0]!
    expect(choice.message.role).toBe('assistant')
    expect(choice.message.content!.length).toBeGreaterThan(0)
    expect(choice.finish_reason).toBe('length')
    expect(data.usage!.completion_tokens).toBe(24)
    expect(data.usage!.prompt_tokens).toBeGreaterThan(0)
    expect(data.usage!.total_tokens).toBe(data.usage!.prompt_tokens + 24)
    expect(response.headers.get('x-shoal-route')).toBe(d.peerId)
    expect(data.id).toBe(`chatcmpl-${response.headers.get('x-shoal-receipt')}`)

    const { data: stream, response: sres } = await d.client.chat.completions.create({
      model: MODEL_ID, messages: USER, max_tokens: 24, temperature: 0, stream: true, stream_options: { include_usage: true },
    }).withResponse()
    expect(sres.headers.get('content-type')).toMatch(/^text\/event-stream/)
    expect(sres.headers.get('x-shoal-route')).toBe(d.peerId)
    const chunks = []
    for await (const chunk of stream) chunks.push(chunk)
    expect(chunks[0]!.choices[0]!.delta).toEqual({ role: 'assistant', content: '' })
    expect(chunks.map(c => c.choices[0]?.delta.content ?? '').join('')).toBe(choice.message.content)
    expect(chunks.filter(c => c.choices[0]?.finish_reason != null).map(c => c.choices[0]!.finish_reason)).toEqual(['length'])
    const last = chunks.at(-1)!
    expect(last.choices).toEqual([])
    expect(last.usage).toEqual(data.usage)
    expect((last as unknown as { shoal: { receipt_id: string } }).shoal.receipt_id).toBe(sres.headers.get('x-shoal-receipt'))
  })

  it('completions: a token-id prompt with return_token_ids reports the ids and exact usage', async () => {
    const { choice, data } = await complete({ prompt: promptIds, max_tokens: 16, temperature: 0, return_token_ids: true })
    expect(choice.prompt_token_ids).toEqual(promptIds)
    expect(choice.token_ids).toHaveLength(16)
    expect(choice.finish_reason).toBe('length')
    expect(data.usage).toEqual({ prompt_tokens: promptIds.length, completion_tokens: 16, total_tokens: promptIds.length + 16 })

    const s = await completeStreaming({ prompt: promptIds, max_tokens: 16, temperature: 0, return_token_ids: true, stream_options: { include_usage: true } })
    expect(s.choices[0]!.prompt_token_ids).toEqual(promptIds)
    expect(s.choices.flatMap(c => c.token_ids ?? [])).toEqual(choice.token_ids)
    expect(s.choices.map(c => c.text).join('')).toBe(choice.text)
    expect(s.last.usage).toEqual(data.usage)
  })

  it('greedy token ids over HTTP equal the float64 reference over a whole 64-token completion', async () => {
    const ref = new ReferenceModel(ck.modelDir).greedy(promptIds, 64)
    // The reference must not hit EOS (the daemon would stop there) nor collapse into one token.
    expect(ref.tokens.some(t => manifest.generation.eosTokenIds.includes(t))).toBe(false)
    expect(new Set(ref.tokens).size).toBeGreaterThanOrEqual(8)
    const whole = await complete({ prompt: promptIds, max_tokens: 64, temperature: 0, return_token_ids: true })
    expect(whole.choice.token_ids).toEqual(ref.tokens)
    const streamed = await completeStreaming({ prompt: promptIds, max_tokens: 64, temperature: 0, return_token_ids: true })
    expect(streamed.choices.flatMap(c => c.token_ids ?? [])).toEqual(ref.tokens)
  })

  it('greedy decoding is deterministic, also with concurrent requests sharing the engine', async () => {
    const params = { prompt: promptIds, max_tokens: 32, temperature: 0, return_token_ids: true }
    const first = await complete(params)
    const again = await Promise.all([complete(params), complete(params), complete({ ...params, seed: 99 }), complete({ ...params, top_p: 0.5 })])
    for (const r of again) expect(r.choice.token_ids).toEqual(first.choice.token_ids)
  })

  it('sampling with temperature > 0 is reproducible by seed', async () => {
    const params = { prompt: promptIds, max_tokens: 32, temperature: 0.9, return_token_ids: true }
    const a = await complete({ ...params, seed: 1234 })
    const b = await complete({ ...params, seed: 1234 })
    const c = await complete({ ...params, seed: 4321 })
    const greedy = await complete({ ...params, temperature: 0 })
    expect(b.choice.token_ids).toEqual(a.choice.token_ids)
    expect(b.choice.text).toBe(a.choice.text)
    // 32 draws at temperature 0.9 over a 512-token vocabulary: another seed or greedy differ somewhere.
    expect(c.choice.token_ids).not.toEqual(a.choice.token_ids)
    expect(greedy.choice.token_ids).not.toEqual(a.choice.token_ids)
    // Chat too, streamed against whole.
    const chat = async (): Promise<string> => (await d.client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 20, temperature: 0.8, seed: 7 })).choices[0]!.message.content!
    const stream = await d.client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 20, temperature: 0.8, seed: 7, stream: true })
    let streamed = ''
    for await (const chunk of stream) streamed += chunk.choices[0]?.delta.content ?? ''
    expect(await chat()).toBe(streamed)
  })

  it('a stop string ends the output before it, with finish_reason stop', async () => {
    const base = await complete({ prompt: promptIds, max_tokens: 48, temperature: 0 })
    const text = base.choice.text
    // A stop string taken from the middle of the greedy output (plain characters only).
    let at = 12
    while (at + 3 <= text.length && !/^[ -~]{3}$/.test(text.slice(at, at + 3))) at++
    expect(at + 3).toBeLessThanOrEqual(text.length)
    const stop = text.slice(at, at + 3)
    const expected = text.slice(0, text.indexOf(stop))

    const whole = await complete({ prompt: promptIds, max_tokens: 48, temperature: 0, stop: [stop, 'never-in-the-output-zz'] })
    expect(whole.choice.text).toBe(expected)
    expect(whole.choice.text).not.toContain(stop)
    expect(whole.choice.finish_reason).toBe('stop')
    expect(whole.data.usage!.completion_tokens).toBeLessThan(48)

    const streamed = await completeStreaming({ prompt: promptIds, max_tokens: 48, temperature: 0, stop })
    expect(streamed.choices.map(c => c.text).join('')).toBe(expected)
    expect(streamed.choices.at(-1)!.finish_reason).toBe('stop')

    const chat = await d.client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 40, temperature: 0 })
    const chatText = chat.choices[0]!.message.content!
    let c = 8
    while (c + 2 <= chatText.length && !/^[ -~]{2}$/.test(chatText.slice(c, c + 2))) c++
    const chatStop = chatText.slice(c, c + 2)
    const stopped = await d.client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 40, temperature: 0, stop: chatStop })
    expect(stopped.choices[0]!.message.content).toBe(chatText.slice(0, chatText.indexOf(chatStop)))
    expect(stopped.choices[0]!.finish_reason).toBe('stop')
  })

  it('max_tokens ends the output with finish_reason length', async () => {
    const chat = await d.client.chat.completions.create({ model: MODEL_ID, messages: USER, max_completion_tokens: 3, temperature: 0 })
    expect(chat.choices[0]!.finish_reason).toBe('length')
    expect(chat.usage!.completion_tokens).toBe(3)
    const { choice, data } = await complete({ prompt: 'Once upon a time', max_tokens: 1, return_token_ids: true })
    expect(choice.finish_reason).toBe('length')
    expect(choice.token_ids).toHaveLength(1)
    expect(data.usage!.completion_tokens).toBe(1)
    // The legacy endpoint's default is 16 tokens, as in OpenAI's API.
    const dflt = await complete({ prompt: 'Once upon a time', temperature: 0, return_token_ids: true })
    expect(dflt.choice.token_ids).toHaveLength(16)
  })

  it('every completion names its route and receipt; the receipt is signed by the peer id and hashes the response', async () => {
    const { choice, data, headers } = await complete({ prompt: promptIds, max_tokens: 12, temperature: 0, return_token_ids: true })
    const receiptId = headers.get('x-shoal-receipt')!
    expect(headers.get('x-shoal-route')).toBe(d.peerId)
    expect(receiptId).toMatch(/^[0-9a-f-]{36}$/)
    expect(data.id).toBe(`cmpl-${receiptId}`)

    const { status, doc } = await getReceipt(receiptId)
    expect(status).toBe(200)
    const publicKey = peerIdFromString(d.peerId).publicKey!.raw
    expect(verifyDocument(doc, publicKey)).toBe(true)
    expect(doc.body).toMatchObject({
      format: 'shoal.receipt/1',
      id: receiptId,
      signer: d.peerId,
      route: [{ peerId: d.peerId }],
      finishReason: 'length',
      usage: { promptTokens: promptIds.length, completionTokens: 12 },
      // The weights that ran: sha256 of the shard directory's manifest.json (shards/manifest.ts manifestHash).
      model: { id: MODEL_ID, manifestHash: manifestFileHash },
    })
    expect(doc.body.responseHash).toBe(sha256Hex(canonicalize({ text: choice.text, tokenIds: choice.token_ids, finishReason: 'length' })))
    // The signature covers the body: change one field and it no longer verifies.
    expect(verifyDocument({ ...doc, body: { ...doc.body, finishReason: 'stop' } }, publicKey)).toBe(false)

    // A streamed chat completion: the header and the last event name the same receipt.
    const { data: stream, response } = await d.client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 6, temperature: 0, stream: true }).withResponse()
    let text = ''
    let last: Record<string, unknown> = {}
    for await (const chunk of stream) { text += chunk.choices[0]?.delta.content ?? ''; last = chunk as unknown as Record<string, unknown> }
    const streamedId = response.headers.get('x-shoal-receipt')!
    expect((last.shoal as { receipt_id: string }).receipt_id).toBe(streamedId)
    const streamed = await getReceipt(streamedId)
    expect(verifyDocument(streamed.doc, publicKey)).toBe(true)
    expect(streamed.doc.body.usage.completionTokens).toBe(6)
    expect(streamed.doc.body.responseHash).toHaveLength(64)
    expect(text.length).toBeGreaterThan(0)

    const missing = await fetchReceipt('no-such-receipt')
    expect(missing.status).toBe(404)
    expect(missing.json).toMatchObject({ error: { type: expect.any(String), code: 'SHOAL_ERR_NOT_FOUND' } })
  })

  // BUG (daemon/node/daemon.ts, ingress part): `receipts: { get: async (id) => await ledger!.get(id) }`
  // serves ledger.get's `{receipt, certificate}` wrapper; ReceiptLookup.get and the contract want the
  // signed document: `(await ledger!.get(id))?.receipt`. Remove `.fails` once fixed.
  it('GET /v1/receipts/{id} returns the signed receipt document {body, signature} with the signer\'s certificate beside it', async () => {
    const { headers } = await complete({ prompt: promptIds, max_tokens: 2, temperature: 0 })
    const { status, json } = await fetchReceipt(headers.get('x-shoal-receipt')!)
    expect(status).toBe(200)
    // `shoal serve` has no CA: its signer is known by its peer id alone.
    expect(Object.keys(json).sort()).toEqual(['body', 'certificate', 'signature'])
    expect(json.certificate).toBeNull()
  })

  it('aborting streams mid-way frees their sequences: a burst up to the concurrency bound then succeeds', async () => {
    // A request that finds every slot busy waits when the wait expected from measured step times
    // (the held streams' remaining ~2,040 tokens at a full batch's step) is within the batch
    // budget, and only beyond it gets a 429. At the default 1 s that is a race with the engine's
    // speed: a tiny model's eight-row step under ~0.49 ms makes the wait fit (a CI run after
    // compiler 13's faster one-position steps waited instead of refusing). So this test runs on a
    // daemon whose budget no such step fits (150 ms: a step would have to be under 0.074 ms), and
    // whose eight short prefills after the aborts still fit it many times over.
    await withOwnDaemon('abort', { batchBudgetMs: 150 }, async (narrow) => {
      // Fill every sequence slot with long streams and read a little of each.
      const long = { prompt: promptIds, max_tokens: 2048 - promptIds.length - 1, temperature: 0 }
      const held = await Promise.all(Array.from({ length: CONCURRENCY }, async () => {
        const { data: stream, response } = await narrow.client.completions.create({ model: MODEL_ID, ...long, stream: true }).withResponse()
        const it = stream[Symbol.asyncIterator]()
        for (let i = 0; i < 2; i++) {
          const r = await it.next()
          expect(r.done).toBe(false)
          expect(r.value!.choices[0]!.finish_reason).toBeNull()
        }
        return { stream, it, receipt: response.headers.get('x-shoal-receipt')! }
      }))
      // Every slot is taken: one more is refused with OpenAI's 429.
      const refused = await narrow.client.completions.create({ model: MODEL_ID, prompt: promptIds, max_tokens: 4 }).then(() => undefined, (err: unknown) => err)
      expect(refused).toBeInstanceOf(RateLimitError)
      expect((refused as RateLimitError).status).toBe(429)

      const busy = await (await fetch(`${narrow.url}/dashboard/state`)).json() as { load: { engines: Array<{ activeSequences?: number }> } }
      expect(busy.load.engines.map(e => e.activeSequences)).toEqual([CONCURRENCY])

      for (const h of held) h.stream.controller.abort()
      // After abort the client's iterator ends (or fails with APIUserAbortError), never with a finish.
      for (const h of held) {
        const r = await h.it.next().catch((err: unknown) => { expect(err).toBeInstanceOf(APIUserAbortError); return { done: true as const, value: undefined } })
        expect(r.done).toBe(true)
      }
      // The daemon sees the disconnects (bounded wait), then a burst up to the bound must be taken
      // at once. A slot comes back only after its sequence's KV is freed in the engine worker, which
      // can trail the HTTP reply's end on a loaded machine (a CI run found all eight still held and
      // refused the burst for 2,040 tokens each that the aborted requests would never make): an
      // aborted request counts as finishing, so the burst waits for those slots instead.
      await waitFor('the aborted requests to end', async () => {
        const text = await (await fetch(`${narrow.url}/metrics`)).text()
        return /shoal_http_requests_in_flight\{route="\/v1\/completions"\} 0\b/.test(text)
      })
      const burst = await Promise.all(Array.from({ length: CONCURRENCY }, async () => await complete({ prompt: promptIds, max_tokens: 8, temperature: 0 }, narrow.client)))
      for (const r of burst) expect(r.choice.finish_reason).toBe('length')
      // Cancelled completions get no receipt.
      for (const h of held) expect((await getReceipt(h.receipt, narrow)).status).toBe(404)
    })
  })

  it('a burst of twice the sequences (16 × 48 tokens) all complete: those beyond the free sequences wait within the budget (issue 13 #1)', async () => {
    // A request waits for a slot when the wait expected from measured step times is within the
    // batch budget, else it gets a 429 — rightly, on a machine loaded enough that 48 steps at a
    // full batch take longer than the default 1 s (a CI run expected 1.8 s). So this burst goes to
    // a daemon whose budget no loaded machine exceeds: what is under test is the queueing path.
    // (test/mesh-e2e/regressions.test.ts sends the same burst through a mesh, to a replica given
    // the same wide budget for the same reason.)
    await withOwnDaemon('burst', { batchBudgetMs: 60_000 }, async (wide) => {
      const burst = await Promise.all(Array.from({ length: 2 * CONCURRENCY }, async () => await complete({ prompt: promptIds, max_tokens: 48, temperature: 0 }, wide.client)))
      for (const r of burst) {
        expect(r.choice.finish_reason).toBe('length')
        expect(r.choice.token_ids ?? r.data.usage?.completion_tokens).toBeTruthy()
        expect(r.data.usage?.completion_tokens).toBe(48)
      }
      // Greedy: every one of them, queued or not, gave the same text.
      expect(new Set(burst.map(r => r.choice.text)).size).toBe(1)
    })
  })

  it('an 8 MB and a 1 MB prompt are refused from their length; /healthz answers throughout (issue 13 #2)', async () => {
    const probe: number[] = []
    let running = true
    const poll = (async () => {
      while (running) {
        const t0 = performance.now()
        expect((await fetch(`${d.url}/healthz`)).status).toBe(200)
        probe.push(performance.now() - t0)
        await new Promise(resolve => setTimeout(resolve, 5))
      }
    })()
    for (const size of [8_000_000, 1_000_000]) {
      const err = await d.client.completions.create({ model: MODEL_ID, prompt: 'x'.repeat(size), max_tokens: 4 }).then(() => undefined, (e: unknown) => e)
      expect((err as { status?: number }).status).toBe(413)
      expect((err as { code?: string }).code).toBe('SHOAL_ERR_CONTEXT_LENGTH')
    }
    running = false
    await poll
    probe.sort((a, b) => a - b)
    // Logged, not asserted; the client shares this process, so its own encoding of 8 MB is in these numbers.
    console.log(`[e2e] /healthz during 8 MB + 1 MB prompts (client in-process): ${probe.length} probes, p99 ${probe[Math.floor(probe.length * 0.99)]?.toFixed(1)} ms, max ${probe.at(-1)?.toFixed(1)} ms`)
  })

  it('max_tokens of 1e9 is a 400 naming the numbers; a lone surrogate is a 400 and leaves no receipt (issue 13 #8, #3)', async () => {
    const err = await d.client.completions.create({ model: MODEL_ID, prompt: promptIds, max_tokens: 1e9 }).then(() => undefined, (e: unknown) => e) as { status?: number, code?: string, message?: string }
    expect(err.status).toBe(400)
    expect(err.code).toBe('SHOAL_ERR_BAD_REQUEST')
    expect(err.message).toContain(`maximum context length is ${manifest.shape.maxPositions} tokens. However, you requested ${promptIds.length + 1e9} tokens (${promptIds.length} in the prompt, 1000000000 in the completion)`)
    const res = await fetch(`${d.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: `{"model":"${MODEL_ID}","messages":[{"role":"user","content":"a\\ud800b"}],"max_tokens":4}` })
    expect(res.status).toBe(400)
    expect(res.headers.get('x-shoal-receipt')).toBeNull()
    expect(((await res.json()) as { error: { param: string } }).error.param).toBe('messages[0].content')
  })

  it('after the daemon stops, `shoal receipts verify` checks the whole log and exits 0', async () => {
    await d.stop()
    expect(await main(['receipts', 'verify', '--data', d.dataDir])).toBe(0)
  })
})
