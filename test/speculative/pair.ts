/**
 * Test fixture: a target and drafts of known agreement, compiled to 1-stage fp32 shard
 * directories: a good draft (the target's first layer; the target's 3 extra layers are scaled by
 * ε), a bad draft (an unrelated model of the same shape and tokenizer) and the target itself;
 * the target also split into 2- and 3-stage shard directories.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { compileShards, generateDraftPair, generateTestModel } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'

export interface DraftPairFixture {
  target: { shardDir: string, graphPath: string, manifest: ShardManifest }
  /** The target split in 2 stages ([0,1], [2,3]) and in 3 ([0,1], [2,2], [3,3]). */
  twoStages: string
  threeStages: string
  goodDraftDir: string
  badDraftDir: string
  cleanup (): Promise<void>
}

export async function buildDraftPair (epsilon = 0.05): Promise<DraftPairFixture> {
  const dir = await mkdtemp(join(tmpdir(), 'shoal-spec-'))
  const { draftDir, targetDir } = await generateDraftPair({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: 'tiny', draftLayers: 1, extraLayers: 3, epsilon })
  await generateTestModel({ architecture: 'llama', outDir: join(dir, 'ckpt', 'bad'), size: 'tiny', layers: 1, seed: 77, modelId: 'bad-draft' })
  const target = await compileShards({ modelDir: targetDir, outDir: join(dir, 'target') })
  await compileShards({ modelDir: targetDir, outDir: join(dir, 'two'), stages: 2 })
  await compileShards({ modelDir: targetDir, outDir: join(dir, 'three'), layers: [[0, 1], [2, 2], [3, 3]] })
  await compileShards({ modelDir: draftDir, outDir: join(dir, 'draft') })
  await compileShards({ modelDir: join(dir, 'ckpt', 'bad'), outDir: join(dir, 'bad') })
  return {
    target: { shardDir: join(dir, 'target'), graphPath: join(dir, 'target', ...target.stages[0]!.graph.split('/')), manifest: target },
    twoStages: join(dir, 'two'),
    threeStages: join(dir, 'three'),
    goodDraftDir: join(dir, 'draft'),
    badDraftDir: join(dir, 'bad'),
    cleanup: () => rm(dir, { recursive: true, force: true }),
  }
}
