/**
 * Runs the backend conformance suite against every backend that loads here, on each of its
 * devices. openvino-node is optional: where it does not load the suite is skipped, saying why.
 */
import { describe, it } from 'vitest'
import { BACKEND_NAMES, loadBackend } from '../../daemon/engine/index.ts'
import { backendConformance } from './backend-conformance.ts'

for (const name of BACKEND_NAMES) {
  let devices: string[] = []
  let unavailable: string | undefined
  try {
    devices = (await loadBackend(name)).devices()
  } catch (err) {
    unavailable = (err as Error).message
  }
  if (unavailable !== undefined || devices.length === 0) {
    const why = unavailable ?? 'it lists no devices'
    console.warn(`[backend conformance] skipping ${name}: ${why}`)
    describe.skip(`backend conformance: ${name} (skipped: ${why})`, () => { it('conformance', () => {}) })
    continue
  }
  for (const device of devices) {
    backendConformance(name, () => loadBackend(name), { device, tolerance: device === 'CPU' ? 1e-4 : 5e-2 })
  }
}
