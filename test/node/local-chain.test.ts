/**
 * Issue 14 item 8: `shoal serve --model SHARDDIR` on a multi-stage shard directory serves every
 * stage on this machine as a local chain (each stage its own engine worker, optional device per
 * stage), giving exactly the tokens of the unsplit model — greedy over a whole 48-token completion
 * and seeded sampling too — with a receipt that carries the other stages' signed parts and verifies.
 * Before, the daemon refused such a directory ("has 3 stages; pick one").
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import OpenAI from 'openai'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { Daemon, DaemonConfig } from '../../daemon/node/index.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'

const logger = pino({ level: 'silent' })
const PROMPT = 'The quick brown fox jumps over the lazy dog. Once upon a time'

let root: string
const daemons: Daemon[] = []
let wholeUrl = ''
let chainUrl = ''

function serveConfig (model: string, name: string, device = 'cpu'): DaemonConfig {
  return {
    models: [{ dir: model }],
    api: { host: '127.0.0.1', port: 0 },
    device,
    dataDir: join(root, `data-${name}`),
    cacheRoot: join(root, 'cache'),
    listen: [],
    bootstrap: [],
    mdns: false,
  }
}

async function serve (config: DaemonConfig): Promise<string> {
  const daemon = createDaemon(validateConfig(config), { logger })
  daemons.push(daemon)
  return (await daemon.start()).apiUrl!
}

async function complete (url: string, params: Record<string, unknown>): Promise<{ ids: number[], route: string | null, receipt: string | null }> {
  const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'x', maxRetries: 0, timeout: 120_000 })
  const { data, response } = await client.completions.create({
    model: 'chain-local', prompt: PROMPT, max_tokens: 48, temperature: 0, ...params,
    // @ts-expect-error vLLM-style extension
    return_token_ids: true,
  }).withResponse()
  return { ids: (data.choices[0] as unknown as { token_ids: number[] }).token_ids, route: response.headers.get('x-shoal-route'), receipt: response.headers.get('x-shoal-receipt') }
}

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-local-chain-'))
  const ckpt = join(root, 'ckpt')
  await generateTestModel({ architecture: 'llama', outDir: ckpt, size: 'tiny', seed: 4 })
  const whole = await compileShards({ modelDir: ckpt, outDir: join(root, 'whole'), modelId: 'chain-local' })
  const L = whole.shape.numLayers
  await compileShards({ modelDir: ckpt, outDir: join(root, 'three'), modelId: 'chain-local', layers: [[0, Math.floor(L / 2) - 1], [Math.floor(L / 2), L - 2], [L - 1, L - 1]] })
  wholeUrl = await serve(serveConfig(join(root, 'whole'), 'whole'))
  // One device per stage (all onnxruntime CPU here: the machine has no GPU or NPU).
  chainUrl = await serve(serveConfig(join(root, 'three'), 'chain', 'cpu,cpu,cpu'))
}, 180_000)

afterAll(async () => {
  for (const d of daemons.reverse()) await d.stop().catch(() => {})
  await rm(root, { recursive: true, force: true })
})

describe('shoal serve on a 3-stage shard directory', () => {
  it('lists the model once, as a whole model', async () => {
    const models = await (await fetch(`${chainUrl}/v1/models`)).json() as { data: Array<{ id: string }> }
    expect(models.data.map(m => m.id)).toEqual(['chain-local'])
  })

  it('greedy: token for token the unsplit model over 48 tokens, through three stages', async () => {
    const expected = await complete(wholeUrl, {})
    expect(expected.ids).toHaveLength(48)
    expect(new Set(expected.ids).size).toBeGreaterThan(4)
    const got = await complete(chainUrl, {})
    expect(got.ids).toEqual(expected.ids)
    // The route names three hops (one per stage).
    expect(got.route?.split(',').length).toBe(3)
  })

  it('seeded sampling: the same tokens as the unsplit model', async () => {
    const params = { temperature: 0.9, top_p: 0.95, seed: 7 }
    expect((await complete(chainUrl, params)).ids).toEqual((await complete(wholeUrl, params)).ids)
  })

  it('concurrent requests through the chain each equal the unsplit model', async () => {
    const expected = (await complete(wholeUrl, { max_tokens: 24 })).ids
    const results = await Promise.all(Array.from({ length: 4 }, async () => await complete(chainUrl, { max_tokens: 24 })))
    for (const r of results) expect(r.ids).toEqual(expected)
  })

  it('the receipt carries the downstream stages\' signed parts (stage 0 is the receipt\'s signer) and verifies on the node', async () => {
    const { receipt } = await complete(chainUrl, { max_tokens: 8 })
    const doc = await (await fetch(`${chainUrl}/v1/receipts/${receipt!}`)).json() as { body: { parts: Array<{ body: { layers: [number, number] } }> } }
    expect(doc.body.parts).toHaveLength(2)
    expect(doc.body.parts.every(p => p.body.layers[0] > 0)).toBe(true)
    const check = await (await fetch(`${chainUrl}/dashboard/receipts/${receipt!}/verify`)).json() as { ok: boolean }
    expect(check.ok).toBe(true)
  })

  it('the dashboard shows the three stages of this node', async () => {
    const state = await (await fetch(`${chainUrl}/dashboard/state`)).json() as {
      models: Array<{ id: string, servedAs: string }>
      load: { engines: Array<{ layers?: [number, number] }> }
      requests: Array<{ route: Array<{ name?: string, layers?: [number, number] }> }>
    }
    expect(state.models).toEqual([expect.objectContaining({ id: 'chain-local', servedAs: 'whole' })])
    expect(state.load.engines.map(e => e.layers?.[0])).toEqual([0, expect.any(Number), expect.any(Number)])
    // Each request's route: three hops, all named as this node, with their layers.
    expect(state.requests[0]!.route.map(h => [h.name, h.layers?.[0]])).toEqual([['this node', 0], ['this node', expect.any(Number)], ['this node', expect.any(Number)]])
  })

  it('a device list must give one device, or one per stage', async () => {
    const daemon = createDaemon(validateConfig(serveConfig(join(root, 'three'), 'bad', 'cpu,cpu')), { logger })
    await expect(daemon.start()).rejects.toMatchObject({ code: 'SHOAL_ERR_STAGE_CONFIG' })
    await daemon.stop().catch(() => {})
    expect(() => validateConfig(serveConfig(join(root, 'three'), 'bad', 'cpu,TPU'))).toThrow(/--device: "TPU"/)
  })
})
