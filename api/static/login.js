// Exchange the operator token for the HttpOnly session cookie, then open the dashboard.
"use strict";
document.getElementById("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const err = document.getElementById("error");
  err.hidden = true;
  const token = document.getElementById("token").value.trim();
  try {
    const r = await fetch("/api/login", {
      method: "POST", credentials: "same-origin",
      headers: {"Content-Type": "application/json"}, body: JSON.stringify({token}),
    });
    if (r.ok) { location.replace("/"); return; }
    const body = await r.json().catch(() => ({}));
    err.textContent = r.status === 401 ? "Wrong operator token." : `Sign-in failed (${r.status}): ${body.error || ""}`;
  } catch (e) {
    err.textContent = `Fleet service unreachable: ${e}`;
  }
  err.hidden = false;
});
