/**
 * Issue 5, "any node serves any request", end to end with real parts: three mesh daemons in this
 * process (createDaemon with an identity, as `shoal node` runs it) on loopback QUIC/TCP with a
 * throwaway CA and mdns off — an ingress with an API and NO model, and two replicas serving a tiny
 * random-weight Llama on onnxruntime — plus a `shoal serve`-style single daemon on the same shard
 * directory as the reference. The real `openai` client talks to the model-less node; greedy output
 * must equal local serving token for token over a whole 64-token completion, whichever replica
 * runs it, and `x-shoal-route` must name that replica.
 */
import { readFile } from 'node:fs/promises'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { Tokenizer } from '@huggingface/tokenizers'
import type OpenAI from 'openai'
import type { CompletionCreateParams } from 'openai/resources/completions'
import { createThrowawayCa } from '../../certs/index.ts'
import { MODEL_ID, makeTinyCheckpoint, startDaemon } from '../e2e/daemon.ts'
import type { RunningDaemon, TinyCheckpoint } from '../e2e/daemon.ts'
import { clientFor, meshOf, sees, startInProcess, waitFor } from './harness.ts'
import type { MeshNode } from './harness.ts'

const PROMPT = 'The quick brown fox jumps over the lazy dog. Once upon a time'
const USER = [{ role: 'user' as const, content: 'What is the capital of France?' }]

interface TokenChoice { text: string, finish_reason: string, token_ids?: number[] }

let ck: TinyCheckpoint
let serve: RunningDaemon
let ingress: MeshNode
let replicas: MeshNode[] = []
let api: OpenAI
let promptIds: number[]
/** The single daemon's greedy 64-token completion: what every routed request must reproduce. */
let expected: number[]

async function complete (client: OpenAI, params: Partial<CompletionCreateParams> & { return_token_ids?: boolean }): Promise<{ choice: TokenChoice, route: string | null, receipt: string | null }> {
  const { data, response } = await client.completions.create({ model: MODEL_ID, prompt: promptIds, temperature: 0, return_token_ids: true, ...params, stream: false } as CompletionCreateParams & { stream: false }).withResponse()
  return { choice: data.choices[0] as unknown as TokenChoice, route: response.headers.get('x-shoal-route'), receipt: response.headers.get('x-shoal-receipt') }
}

beforeAll(async () => {
  ck = await makeTinyCheckpoint({ compile: true })
  const tok = new Tokenizer(
    JSON.parse(await readFile(join(ck.modelDir, 'tokenizer.json'), 'utf8')),
    JSON.parse(await readFile(join(ck.modelDir, 'tokenizer_config.json'), 'utf8')),
  )
  promptIds = tok.encode(PROMPT).ids
  serve = await startDaemon(ck.shardDir, join(ck.root, 'serve'))
  expected = (await complete(serve.client, { max_tokens: 64 })).choice.token_ids!

  const ca = await createThrowawayCa(join(ck.root, 'pki'), ['ingress', 'replica-1', 'replica-2'])
  const [a, b, c] = ca.identities
  ingress = await startInProcess({ name: 'ingress', identityDir: a!.dir, root: ck.root, api: true, bootstrap: [] })
  // One replica with an API of its own, one worker without.
  replicas = [
    await startInProcess({ name: 'replica-1', identityDir: b!.dir, root: ck.root, model: ck.shardDir, api: true, bootstrap: ingress.addrs }),
    await startInProcess({ name: 'replica-2', identityDir: c!.dir, root: ck.root, model: ck.shardDir, api: false, bootstrap: ingress.addrs }),
  ]
  api = clientFor(ingress.url!)
  await waitFor('the ingress to see both replicas alive with the model and their load', async () => await sees(ingress.url!, replicas.map(r => r.peerId), MODEL_ID))
})

afterAll(async () => {
  for (const n of [ingress, ...replicas].reverse()) await n?.stop().catch(() => {})
  await serve?.stop()
  await ck?.cleanup()
})

describe('a node with an API and no model serves requests through the mesh', () => {
  it('the reference completion is a real one (64 tokens, no collapse)', () => {
    expect(expected).toHaveLength(64)
    expect(new Set(expected).size).toBeGreaterThanOrEqual(8)
  })

  it('greedy 64-token completions equal local serving token for token, on both replicas; x-shoal-route names the replica', async () => {
    const routes = new Set<string>()
    // Batches of concurrent requests until both replicas have run some: with a sequential client
    // the replica whose measured decode rate is higher would win every time on a loaded machine.
    for (let batch = 0; batch < 6 && routes.size < 2; batch++) {
      const results = await Promise.all(Array.from({ length: 6 }, async () => await complete(api, { max_tokens: 64 })))
      for (const r of results) {
        expect(r.choice.token_ids).toEqual(expected)
        expect(r.choice.finish_reason).toBe('length')
        expect(replicas.map(n => n.peerId)).toContain(r.route)
        routes.add(r.route!)
      }
    }
    expect([...routes].sort()).toEqual(replicas.map(n => n.peerId).sort())
  })

  it('streaming through the mesh yields the same ids and text as local serving', async () => {
    const local = await complete(serve.client, { max_tokens: 64 })
    const { data: stream, response } = await api.completions.create({
      model: MODEL_ID, prompt: promptIds, max_tokens: 64, temperature: 0, stream: true, return_token_ids: true, stream_options: { include_usage: true },
    } as CompletionCreateParams & { stream: true }).withResponse()
    expect(replicas.map(n => n.peerId)).toContain(response.headers.get('x-shoal-route'))
    const choices: TokenChoice[] = []
    let usage: unknown
    for await (const chunk of stream) {
      if (chunk.choices[0] !== undefined) choices.push(chunk.choices[0] as unknown as TokenChoice)
      if (chunk.usage != null) usage = chunk.usage
    }
    expect(choices.flatMap(c => c.token_ids ?? [])).toEqual(expected)
    expect(choices.map(c => c.text).join('')).toBe(local.choice.text)
    expect(usage).toEqual({ prompt_tokens: promptIds.length, completion_tokens: 64, total_tokens: promptIds.length + 64 })
  })

  it('chat completions (the chat template runs on the replica) equal local serving', async () => {
    const local = await serve.client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 40, temperature: 0 })
    const { data, response } = await api.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 40, temperature: 0 }).withResponse()
    expect(data.choices[0]!.message.content).toBe(local.choices[0]!.message.content)
    expect(data.usage).toEqual(local.usage)
    expect(replicas.map(n => n.peerId)).toContain(response.headers.get('x-shoal-route'))
    // Seeded sampling is reproduced exactly too (the sampler runs on the replica with the same seed).
    const sampled = { model: MODEL_ID, messages: USER, max_tokens: 24, temperature: 0.9, seed: 11 }
    const a = await serve.client.chat.completions.create(sampled)
    const b = await api.chat.completions.create(sampled)
    expect(b.choices[0]!.message.content).toBe(a.choices[0]!.message.content)
  })

  it('the forwarded completion gets a receipt on the ingress, naming the replica in its route', async () => {
    const r = await complete(api, { max_tokens: 8 })
    const res = await fetch(`${ingress.url!}/v1/receipts/${r.receipt!}`)
    expect(res.status).toBe(200)
    const doc = await res.json() as Record<string, any>
    expect(doc.body.route).toEqual([{ peerId: r.route }])
    expect(doc.body.signer).toBe(ingress.peerId)
    // The replica signed its share, bound to the same response.
    expect(doc.body.parts.map((p: { body: { peerId: string } }) => p.body.peerId)).toEqual([r.route])
    expect(doc.body.parts[0].body.outputHash).toBe(doc.body.responseHash)
    expect(doc.certificate.body.peerId).toBe(ingress.peerId)
  })

  it('concurrent requests spread over both replicas, and every one is still exact', async () => {
    // Twice one replica's slots (8 each): routing fills free slots before queueing anywhere, so both
    // must run some whatever their measured speeds. (With fewer, piling onto the replica whose
    // batched step is cheaper is a legitimate choice.)
    const results = await Promise.all(Array.from({ length: 16 }, async () => await complete(api, { max_tokens: 64 })))
    for (const r of results) expect(r.choice.token_ids).toEqual(expected)
    const byRoute = new Map<string, number>()
    for (const r of results) byRoute.set(r.route!, (byRoute.get(r.route!) ?? 0) + 1)
    expect([...byRoute.keys()].sort()).toEqual(replicas.map(n => n.peerId).sort())
    // The ingress's metrics saw them all answered 200.
    const metrics = await (await fetch(`${ingress.url!}/metrics`)).text()
    const ok = /shoal_http_requests_total\{method="POST",route="\/v1\/completions",status="200"\} (\d+)/.exec(metrics)
    expect(Number(ok?.[1] ?? 0)).toBeGreaterThanOrEqual(16)
  })

  it('GET /v1/models on the model-less node lists the model with served_by naming both replicas', async () => {
    const page = await api.models.list()
    expect(page.data.map(m => m.id)).toEqual([MODEL_ID])
    const card = page.data[0] as unknown as { served_by: string[], context_length: number, owned_by: string }
    expect([...card.served_by].sort()).toEqual(replicas.map(n => n.peerId).sort())
    expect(card.served_by).not.toContain(ingress.peerId)
    expect(card.context_length).toBe(2048)
  })

  it('GET /v1/mesh shows both replicas admitted and alive with their models, load and RTT', async () => {
    const mesh = await meshOf(ingress.url!)
    expect(mesh.self.peerId).toBe(ingress.peerId)
    expect(mesh.self.name).toBe('ingress')
    for (const [i, r] of replicas.entries()) {
      const p = mesh.peers.find(x => x.peerId === r.peerId)
      expect(p, `replica-${i + 1} in /v1/mesh`).toBeDefined()
      expect(p).toMatchObject({ name: `replica-${i + 1}`, admitted: true, state: 'alive', models: [expect.objectContaining({ id: MODEL_ID })] })
      expect(p!.models[0]!.layers).toBeUndefined()
      // Served without --draft on fp32 shards: prompt lookup by default, and it says so.
      expect(p!.models[0]!.drafter).toBe('prompt-lookup (default)')
      expect(p!.load).toMatchObject({ inFlight: expect.any(Number), queueDepth: expect.any(Number) })
      expect(typeof p!.rttMs).toBe('number')
      expect(p!.rttMs!).toBeGreaterThanOrEqual(0)
    }
  })

  it('the replica with its own API serves locally (x-shoal-route is itself) with the same tokens', async () => {
    const own = clientFor(replicas[0]!.url!)
    const r = await complete(own, { max_tokens: 64 })
    expect(r.choice.token_ids).toEqual(expected)
    expect(r.route).toBe(replicas[0]!.peerId)
  })

  it('an unknown model is a 404 in OpenAI\'s shape (a 503 while the node has just joined)', async () => {
    const ask = async (): Promise<Response> => await fetch(`${ingress.url!}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'nobody-serves-this', prompt: 'hi', max_tokens: 2 }),
    })
    // For a caps republish interval after it joined, the node may not have heard of every model.
    let res = await ask()
    await waitFor('the ingress\'s join window to pass', async () => {
      if (res.status !== 503) return true
      expect(((await res.json()) as { error: { code: string } }).error.code).toBe('SHOAL_ERR_NO_ELIGIBLE_NODE')
      res = await ask()
      return false
    }, 30_000)
    expect(res.status).toBe(404)
    const body = await res.json() as { error: { message: string, type: string, code: string } }
    expect(body.error).toMatchObject({ type: 'invalid_request_error', code: 'SHOAL_ERR_MODEL_NOT_FOUND' })
    expect(body.error.message).toContain('nobody-serves-this')
  })
})
