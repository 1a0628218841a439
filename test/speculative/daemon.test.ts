/**
 * `shoal serve --draft DIR` / `--draft lookup` end to end: the real daemon (createDaemon in serve
 * mode) with a draft model beside the target, the real `openai` client; greedy tokens equal the
 * independent onnxruntime loop, and /metrics shows the drafted and accepted counts. Without
 * `--draft`, prompt lookup is on by default where it keeps the contract (fp32 and f32-activation
 * shards; greedy and unseeded requests) and off for int8-activation shards, seeded sampled
 * requests and `--draft none`.
 */
import { join } from 'node:path'
import OpenAI from 'openai'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { DaemonConfig } from '../../daemon/node/index.ts'
import { compileShards } from '../../shards/index.ts'
import { referenceGreedy } from '../engine/reference-greedy.ts'
import { buildDraftPair } from './pair.ts'
import type { DraftPairFixture } from './pair.ts'

interface TokenChoice { text: string, prompt_token_ids?: number[], token_ids?: number[] }

describe('shoal serve with --draft', () => {
  let pair: DraftPairFixture
  const stops: Array<() => Promise<void>> = []
  async function serve (draft: string | undefined, shardDir = pair.target.shardDir, extra: Partial<DaemonConfig> = {}): Promise<{ url: string, client: OpenAI }> {
    const root = join(pair.target.shardDir, '..', `run-${stops.length}`)
    const daemon = createDaemon(validateConfig({
      ...extra,
      models: [{ dir: shardDir }],
      ...(draft === undefined ? {} : { draft }),
      api: { host: '127.0.0.1', port: 0 },
      device: 'cpu',
      dataDir: join(root, 'data'),
      cacheRoot: join(root, 'cache'),
      listen: [],
      bootstrap: [],
      mdns: false,
    }), { logger: pino({ level: 'silent' }) })
    const { apiUrl } = await daemon.start()
    stops.push(async () => { await daemon.stop() })
    return { url: apiUrl!, client: new OpenAI({ baseURL: `${apiUrl}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 }) }
  }
  beforeAll(async () => { pair = await buildDraftPair() })
  afterAll(async () => {
    for (const stop of stops) await stop()
    await pair?.cleanup()
  })

  for (const draft of ['good', 'lookup']) {
    it(`greedy completions equal the reference loop, and /metrics counts the drafts (${draft})`, async () => {
      const { url, client } = await serve(draft === 'good' ? pair.goodDraftDir : 'lookup')
      const params = { model: pair.target.manifest.modelId, prompt: 'one two three one two three one two', max_tokens: 32, temperature: 0, return_token_ids: true }
      const res = await client.completions.create(params as Parameters<typeof client.completions.create>[0] & { stream?: false })
      const choice = res.choices[0] as unknown as TokenChoice
      const want = await referenceGreedy(pair.target.graphPath, pair.target.manifest.shape, choice.prompt_token_ids!, 32)
      expect(choice.token_ids).toEqual(want)
      const metrics = await (await fetch(`${url}/metrics`)).text()
      const drafted = new RegExp(`shoal_speculative_drafted_tokens_total\\{model="${pair.target.manifest.modelId}",drafter="${draft === 'good' ? 'draft:draft' : 'prompt-lookup'}"\\} (\\d+)`).exec(metrics)
      expect(drafted, metrics.split('\n').filter(l => l.includes('speculative')).join('\n')).not.toBeNull()
      expect(Number(drafted![1])).toBeGreaterThan(0)
      // The signed receipt records the drafter and its counts.
      const receiptId = (res as unknown as { shoal: { receipt_id: string } }).shoal.receipt_id
      const receipt = await (await fetch(`${url}/v1/receipts/${receiptId}`)).json() as { body: { speculation?: { drafter: string, drafted: number, accepted: number } } }
      expect(receipt.body.speculation?.drafter).toBe(draft === 'good' ? 'draft:draft' : 'prompt-lookup')
      expect(receipt.body.speculation!.drafted).toBeGreaterThan(0)
      expect(receipt.body.speculation!.accepted).toBeLessThanOrEqual(receipt.body.speculation!.drafted)
    })
  }

  type Receipted = { choices: unknown[], shoal: { receipt_id: string } }
  const complete = async (client: OpenAI, params: Record<string, unknown>): Promise<{ tokens: number[], prompt: number[], receiptId: string }> => {
    const res = await client.completions.create({ model: pair.target.manifest.modelId, return_token_ids: true, ...params } as unknown as Parameters<typeof client.completions.create>[0] & { stream?: false }) as unknown as Receipted
    const choice = res.choices[0] as TokenChoice
    return { tokens: choice.token_ids!, prompt: choice.prompt_token_ids!, receiptId: res.shoal.receipt_id }
  }
  const speculationOf = async (url: string, receiptId: string): Promise<{ drafter: string, drafted: number, accepted: number } | undefined> =>
    (await (await fetch(`${url}/v1/receipts/${receiptId}`)).json() as { body: { speculation?: { drafter: string, drafted: number, accepted: number } } }).body.speculation

  it('without --draft: prompt lookup by default for greedy and unseeded requests, shown as such; seeded sampled requests decode plainly (the same tokens as --draft none)', async () => {
    const on = await serve(undefined)
    const off = await serve('none')
    const prompt = 'one two three one two three one two'
    // 96 tokens: this random target repeats only now and then (two-token matches, one step at a
    // time), and a round comes where a match meets an engine worker holding no run-ahead picks.
    const greedy = await complete(on.client, { prompt, max_tokens: 96, temperature: 0 })
    expect(greedy.tokens).toEqual(await referenceGreedy(pair.target.graphPath, pair.target.manifest.shape, greedy.prompt, 96))
    const spec = await speculationOf(on.url, greedy.receiptId)
    expect(spec?.drafter).toBe('prompt-lookup (default)')
    expect(spec!.drafted).toBeGreaterThan(0)
    expect(await (await fetch(`${on.url}/metrics`)).text()).toMatch(/shoal_speculative_drafted_tokens_total\{model="[^"]+",drafter="prompt-lookup \(default\)"\} [1-9]/)
    // Unseeded sampling: speculative (the distribution is the model's; no draw was promised).
    const unseeded = await complete(on.client, { prompt, max_tokens: 16, temperature: 0.8 })
    expect((await speculationOf(on.url, unseeded.receiptId))?.drafter).toBe('prompt-lookup (default)')
    // Seeded sampling keeps the plain path: no speculation, and the tokens of a node without it.
    const seeded = { prompt, max_tokens: 24, temperature: 0.8, seed: 1234 }
    const a = await complete(on.client, seeded)
    const b = await complete(off.client, seeded)
    expect(await speculationOf(on.url, a.receiptId)).toBeUndefined()
    expect(a.tokens).toEqual(b.tokens)
    // --draft none: nothing speculates, nothing is declared.
    const plain = await complete(off.client, { prompt, max_tokens: 96, temperature: 0 })
    expect(plain.tokens).toEqual(greedy.tokens)
    expect(await speculationOf(off.url, plain.receiptId)).toBeUndefined()
    expect(await (await fetch(`${off.url}/metrics`)).text()).not.toMatch(/shoal_speculative_drafted_tokens_total\{/)
  })

  it('without --draft: int8-activation shards on onnxruntime\'s kernels decode plainly, without an error', async () => {
    // (On shoal's kernels they speculate exactly: test/engine/native-kernels.test.ts.)
    const dir = join(pair.target.shardDir, '..', 'int4')
    await compileShards({ modelDir: join(pair.target.shardDir, '..', 'ckpt', 'target'), outDir: dir, quant: 'int4' })
    const { url, client } = await serve(undefined, dir, { kernels: 'onnxruntime' })
    const res = await complete(client, { prompt: 'one two three one two three one two', max_tokens: 16, temperature: 0 })
    expect(res.tokens.length).toBeGreaterThan(0)
    expect(await speculationOf(url, res.receiptId)).toBeUndefined()
    expect(await (await fetch(`${url}/metrics`)).text()).not.toMatch(/shoal_speculative_drafted_tokens_total\{/)
  })

  it('an empty --draft is a config error naming the flag', () => {
    expect(() => validateConfig({ models: [], identityDir: 'x', draft: '', device: 'cpu', dataDir: 'd', cacheRoot: 'c', listen: [], bootstrap: [], mdns: false })).toThrow(/--draft/)
  })
})
