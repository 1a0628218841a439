/**
 * The intra-op spinning policy of onnxruntime sessions (daemon/engine/backend/onnxruntime.ts):
 * threads spin within a run and stop when it returns, unless the session owns the cores. The
 * binding flattens the object into session config keys; a misspelt key would be ignored silently,
 * so the exact keys are pinned here, and a real session is created with them.
 */
import * as ort from 'onnxruntime-node'
import { describe, expect, it } from 'vitest'
import { spinning } from '../../daemon/engine/backend/onnxruntime.ts'
import { buildTinyModel } from './tiny-model.ts'

/** The binding's flattening: nested keys joined by dots. */
function flatten (o: Record<string, unknown>, prefix = ''): Record<string, unknown> {
  return Object.fromEntries(Object.entries(o).flatMap(([k, v]) => typeof v === 'object' && v !== null
    ? Object.entries(flatten(v as Record<string, unknown>, `${prefix}${k}.`))
    : [[`${prefix}${k}`, v]]))
}

describe('onnxruntime spinning policy', () => {
  it('spins within a run and stops after it on shared cores', () => {
    expect(flatten(spinning(false))).toEqual({ 'session.intra_op.allow_spinning': '1', 'session.force_spinning_stop': '1' })
  })

  it('keeps spinning between runs on exclusive cores', () => {
    expect(flatten(spinning(true))).toEqual({ 'session.intra_op.allow_spinning': '1', 'session.force_spinning_stop': '0' })
  })

  it('is accepted by a real session', async () => {
    const model = await buildTinyModel()
    try {
      const s = await ort.InferenceSession.create(model.graphPath, { intraOpNumThreads: 2, extra: spinning(false) })
      expect(s.inputNames.length).toBeGreaterThan(0)
      await s.release()
    } finally {
      await model.cleanup()
    }
  })
})
