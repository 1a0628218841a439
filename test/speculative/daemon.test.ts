/**
 * `shoal serve --draft DIR` / `--draft lookup` end to end: the real daemon (createDaemon in serve
 * mode) with a draft model beside the target, the real `openai` client; greedy tokens equal the
 * independent onnxruntime loop, and /metrics shows the drafted and accepted counts.
 */
import { join } from 'node:path'
import OpenAI from 'openai'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import { referenceGreedy } from '../engine/reference-greedy.ts'
import { buildDraftPair } from './pair.ts'
import type { DraftPairFixture } from './pair.ts'

interface TokenChoice { text: string, prompt_token_ids?: number[], token_ids?: number[] }

describe('shoal serve with --draft', () => {
  let pair: DraftPairFixture
  const stops: Array<() => Promise<void>> = []
  async function serve (draft: string): Promise<{ url: string, client: OpenAI }> {
    const root = join(pair.target.shardDir, '..', `run-${stops.length}`)
    const daemon = createDaemon(validateConfig({
      models: [{ dir: pair.target.shardDir }],
      draft,
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

  it('an empty --draft is a config error naming the flag', () => {
    expect(() => validateConfig({ models: [], identityDir: 'x', draft: '', device: 'cpu', dataDir: 'd', cacheRoot: 'c', listen: [], bootstrap: [], mdns: false })).toThrow(/--draft/)
  })
})
